"""cffi out-of-line API-mode builder for ``ffi._llama``.

Compiles a small extension against the pinned ``llama.h`` (declarations in
``ffi/llama.cdef.h``), plus our own C helpers (``ffi/helpers.h``), and links it to the shared
libraries that ``vendor/build.sh`` put in the cache, with an rpath so that no
``LD_LIBRARY_PATH`` is needed.

Run ``python build_ffi.py`` (the Makefile does) to build in place. It does nothing when the
extension is already built from the same declarations, helpers, builder and llama.cpp prefix.
The prefix is ``$LLAMA_CPP_PREFIX`` when set, else the one ``vendor/build.sh --print-prefix``
names.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

from cffi import FFI

ROOT = pathlib.Path(__file__).resolve().parent
CDEF = ROOT / "ffi" / "llama.cdef.h"
HELPERS = ROOT / "ffi" / "helpers.h"
STAMP = ROOT / "ffi" / ".build-stamp"
MODULE = "ffi._llama"


def llama_prefix() -> pathlib.Path:
    env = os.environ.get("LLAMA_CPP_PREFIX")
    if env:
        return pathlib.Path(env)
    out = subprocess.run(
        [str(ROOT / "vendor" / "build.sh"), "--print-prefix"], check=True, capture_output=True, text=True
    )
    return pathlib.Path(out.stdout.strip())


def make_builder(prefix: pathlib.Path) -> FFI:
    builder = FFI()
    builder.cdef(CDEF.read_text())
    lib_dir = str(prefix / "lib")
    builder.set_source(
        MODULE,
        '#include "llama.h"\n#include "helpers.h"',
        include_dirs=[str(prefix / "include"), str(HELPERS.parent)],
        library_dirs=[lib_dir],
        libraries=["llama", "ggml", "ggml-base"],
        extra_link_args=[f"-Wl,-rpath,{lib_dir}"],
    )
    return builder


def _fingerprint(prefix: pathlib.Path) -> str:
    h = hashlib.sha256()
    for part in (CDEF.read_bytes(), HELPERS.read_bytes(), pathlib.Path(__file__).read_bytes(), str(prefix).encode()):
        h.update(part)
        h.update(b"\0")
    lib = prefix / "lib" / "libllama.so"
    if lib.exists():
        h.update(str(lib.stat().st_mtime_ns).encode())
    return h.hexdigest()


def main() -> int:
    prefix = llama_prefix()
    if not (prefix / "include" / "llama.h").exists():
        print(f"build_ffi: no llama.h under {prefix}; run vendor/build.sh first", file=sys.stderr)
        return 1
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    target = ROOT / "ffi" / f"_llama{suffix}"
    fingerprint = _fingerprint(prefix)
    if target.exists() and STAMP.exists() and STAMP.read_text() == fingerprint:
        return 0
    tmp = ROOT / "build" / "ffi"
    tmp.mkdir(parents=True, exist_ok=True)
    built = make_builder(prefix).compile(tmpdir=str(tmp), verbose=False)
    shutil.copy2(built, target)
    STAMP.write_text(fingerprint)
    print(f"build_ffi: built {target.relative_to(ROOT)} against {prefix}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
