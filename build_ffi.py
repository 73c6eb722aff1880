"""Builds the cffi extension ``ffi._llama`` with llama.cpp's shared libraries beside it.

One build, two entry points (docs/build.md):

- ``python build_ffi.py`` (``make ffi``): in place, into the checkout's ``ffi/``. It does nothing
  when the extension is already built from the same declarations, helpers, builder and
  llama.cpp build.
- ``pip install`` / ``pip wheel``: ``setup.py``'s ``build_ext`` calls ``build`` with the wheel's
  ``ffi/`` as the target.

``build`` runs ``vendor/build.sh`` (fetch the pinned llama.cpp source, hash-checked, and build the
shared libraries into the cache, keyed by pin, flags and CPU; a no-op when that build is there,
or when ``LLAMA_CPP_PREFIX`` names an existing install), copies the llama/ggml libraries of that
prefix next to the extension under their sonames, and compiles the extension (declarations in
``ffi/llama.cdef.h``, our C helpers in ``ffi/helpers.h``) linked to those copies, with ``$ORIGIN``
as its only run-time search path: the result needs neither the cache nor the checkout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator, Mapping

from cffi import FFI

ROOT = pathlib.Path(__file__).resolve().parent
CDEF = ROOT / "ffi" / "llama.cdef.h"
HELPERS = ROOT / "ffi" / "helpers.h"
BUILD_SH = ROOT / "vendor" / "build.sh"
STAMP = ROOT / "ffi" / ".build-stamp"
MODULE = "ffi._llama"

# The libraries we ship: llama.cpp's and ggml's (every ggml backend the build has), each under
# its soname (libllama.so.0), which is the name the dynamic linker looks for.
_SHIPPED = re.compile(r"lib(?:llama|ggml)[\w-]*\.so(?:\.\d+)?")
# What a previous build left in the target directory (and nothing else there matches).
_OLD_COPIES = ("libllama*.so*", "libggml*.so*")


def llama_prefix() -> pathlib.Path:
    """Build llama.cpp's libraries when they are missing (``vendor/build.sh``), and return the
    prefix that holds them: ``$LLAMA_CPP_PREFIX`` when set, else the cache's install for this
    pin, ``CMAKE_ARGS`` and CPU."""
    # fetch.sh downloads the pinned sdist with `$PYTHON -m pip`; under pip's build isolation this
    # interpreter has pip because pyproject.toml's build requirements name it.
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON") or sys.executable}
    subprocess.run([str(BUILD_SH)], check=True, env=env)
    out = subprocess.run([str(BUILD_SH), "--print-prefix"], check=True, capture_output=True, text=True, env=env)
    return pathlib.Path(out.stdout.strip())


def shipped_names(entries: Mapping[str, str]) -> dict[str, str]:
    """Which files of a ``lib/`` directory to ship, and under which name.

    ``entries`` maps each name in the directory to the file it resolves to (symlinks followed).
    Per file of the llama/ggml family, the answer names it by its soname-style name
    (``libllama.so.0``), or by its plain ``.so`` name when it has no versioned one.
    """
    by_file: dict[str, list[str]] = {}
    for name, real in entries.items():
        if _SHIPPED.fullmatch(name):
            by_file.setdefault(real, []).append(name)
    shipped = {}
    for real, names in by_file.items():
        versioned = sorted(n for n in names if not n.endswith(".so"))
        shipped[(versioned or names)[0]] = real
    return dict(sorted(shipped.items()))


def bundle_libraries(prefix: pathlib.Path, target_dir: pathlib.Path) -> list[pathlib.Path]:
    """Copy the llama/ggml libraries of ``prefix/lib`` into ``target_dir`` (replacing what an
    earlier build put there); the copies, in name order."""
    lib_dir = prefix / "lib"
    entries = {p.name: str(p.resolve()) for p in lib_dir.iterdir() if p.is_file()}
    chosen = shipped_names(entries)
    if not any(name.startswith("libllama.") for name in chosen):
        raise FileNotFoundError(f"no libllama.so under {lib_dir}")
    target_dir.mkdir(parents=True, exist_ok=True)
    for pattern in _OLD_COPIES:
        for old in target_dir.glob(pattern):
            if old.name not in chosen:
                old.unlink()
    copies = []
    for name, real in chosen.items():
        copies.append(_install(pathlib.Path(real), target_dir / name))
    return copies


def _install(source: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    """Copy ``source`` to ``target`` as a new file put in place by one rename: a server running
    from this tree keeps the file it mapped (rewriting a loaded shared object in place crashes
    the processes that use it), and one starting meanwhile finds the old file or the new one."""
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        shutil.copyfile(source, partial)
        partial.chmod(0o755)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def make_builder(prefix: pathlib.Path, libraries: list[pathlib.Path]) -> FFI:
    """The cffi builder: linked to ``libraries`` (every one of them, so each is found through
    the extension's own ``$ORIGIN``, whatever search path the copies carry), run-time search
    path ``$ORIGIN`` only."""
    builder = FFI()
    builder.cdef(CDEF.read_text())
    builder.set_source(
        MODULE,
        '#include "llama.h"\n#include "helpers.h"',
        include_dirs=[str(prefix / "include"), str(HELPERS.parent)],
        extra_link_args=[
            "-Wl,--push-state,--no-as-needed",
            *map(str, libraries),
            "-Wl,--pop-state",
            "-Wl,-rpath,$ORIGIN",
        ],
    )
    return builder


@contextlib.contextmanager
def _link_command_without_rpaths() -> Iterator[None]:
    """Link with Python's own shared-object command less the absolute rpaths some Pythons put in
    it (pyenv's: ``-Wl,-rpath,<prefix>/lib``), so the extension searches ``$ORIGIN`` only. An
    ``LDSHARED`` from the environment is the user's and is left alone."""
    if "LDSHARED" in os.environ:
        yield
        return
    ldshared = shlex.split(sysconfig.get_config_var("LDSHARED") or "")
    os.environ["LDSHARED"] = shlex.join(t for t in ldshared if not t.startswith(("-Wl,-rpath", "-Wl,-R")))
    try:
        yield
    finally:
        del os.environ["LDSHARED"]


def build(ext_path: pathlib.Path, tmp_dir: pathlib.Path, prefix: pathlib.Path | None = None) -> list[pathlib.Path]:
    """Build llama.cpp when needed (unless ``prefix`` is given: ``llama_prefix()`` done), bundle
    its libraries into ``ext_path``'s directory and compile the extension to ``ext_path``; the
    files written, the extension last."""
    ext_path, tmp_dir = ext_path.resolve(), tmp_dir.resolve()  # cffi compiles from inside tmp_dir
    prefix = prefix or llama_prefix()
    if not (prefix / "include" / "llama.h").exists():
        raise FileNotFoundError(f"no include/llama.h under {prefix}")
    libraries = bundle_libraries(prefix, ext_path.parent)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    with _link_command_without_rpaths():
        built = make_builder(prefix, libraries).compile(tmpdir=str(tmp_dir), verbose=False)
    _install(pathlib.Path(built), ext_path)
    return [*libraries, ext_path]


def _fingerprint(prefix: pathlib.Path) -> str:
    h = hashlib.sha256()
    for part in (CDEF.read_bytes(), HELPERS.read_bytes(), pathlib.Path(__file__).read_bytes(), str(prefix).encode()):
        h.update(part)
        h.update(b"\0")
    lib = prefix / "lib" / "libllama.so"
    if lib.exists():
        h.update(str(lib.stat().st_mtime_ns).encode())
    return h.hexdigest()


def _up_to_date(fingerprint: str) -> bool:
    try:
        stamp = json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return False
    files = stamp.get("files") if isinstance(stamp, dict) else None
    return (
        stamp.get("fingerprint") == fingerprint
        and isinstance(files, list)
        and all((STAMP.parent / name).is_file() for name in files)
    )


def main() -> int:
    """The in-place build (``make ffi``), skipped when nothing it depends on changed."""
    ext_path = ROOT / "ffi" / f"_llama{sysconfig.get_config_var('EXT_SUFFIX')}"
    try:
        prefix = llama_prefix()
        fingerprint = _fingerprint(prefix)
        if _up_to_date(fingerprint):
            return 0
        STAMP.unlink(missing_ok=True)
        written = build(ext_path, ROOT / "build" / "ffi", prefix)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        print(f"build_ffi: {exc}", file=sys.stderr)
        return 1
    STAMP.write_text(json.dumps({"fingerprint": fingerprint, "files": [p.name for p in written]}))
    print(f"build_ffi: built {ext_path.relative_to(ROOT)} against {prefix}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
