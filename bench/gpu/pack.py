"""Pack what the GPU benchmark needs on a machine with no network (``bench/gpu/run.sh``), into
``.gpu-payload/`` at the repository's root (git-ignored; the device call carries it):

- ``llama.cpp.tar.xz``: the pinned llama.cpp tree less what no build of libllama, the CUDA
  backend and llama-server reads (models, docs, tests, the web UI's sources, other backends);
- ``wheels/``: our runtime dependencies (and ``gguf``) as CPython 3.12 manylinux wheels, at the
  versions installed here, and setuptools (the binding's build), from PyPI through pip;
- ``tokenizer.gguf``: the default model's tokenizer and chat template, no weights
  (``bench.random_model``), from which the device makes its random-weight model.

    python -m bench.gpu.pack [--check-build DIR]

``--check-build`` names a finished CMake build directory of the same tree (the cache's, with
llama-server built): every source and header its compiler dependency files list must be in the
pack. The device machine takes at most 64 MiB with the working tree: the pack says its size.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import lzma
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile

from bench import random_model
from bench.common import REPO_ROOT

PAYLOAD = REPO_ROOT / ".gpu-payload"
SOURCE = REPO_ROOT / "vendor" / "llama.cpp"
LIMIT_BYTES = 64 * 1024 * 1024  # what one device call carries, working tree included

# Top-level parts of the tree no build of ours reads.
_SKIP_TOP = {
    "models", "docs", "tests", "benches", "examples", "pocs", "conversion", "gguf-py", "media",
    ".github", ".devops", "skills", "ci", "requirements", "grammars",
}  # fmt: skip
# ggml backends other than the CPU's, CUDA's and RPC's.
_SKIP_GGML = {
    "ggml-blas", "ggml-cann", "ggml-et", "ggml-hexagon", "ggml-hip", "ggml-metal", "ggml-musa",
    "ggml-opencl", "ggml-openvino", "ggml-sycl", "ggml-virtgpu", "ggml-vulkan", "ggml-webgpu",
    "ggml-zdnn", "ggml-zendnn",
}  # fmt: skip
# The web UI's sources and tests (the build runs without npm and without its prebuilt assets).
_SKIP_UI = {"src", "tests", "static"}

# Our runtime dependencies (pyproject.toml), what they need on Python 3.12, and gguf (the model
# generator); numpy, PyYAML and tqdm are on the device already.
WHEELS = (
    "cffi", "pycparser", "trio", "attrs", "sortedcontainers", "idna", "outcome", "sniffio",
    "hypercorn", "h11", "h2", "hpack", "hyperframe", "priority", "wsproto", "quart", "aiofiles",
    "blinker", "click", "flask", "itsdangerous", "jinja2", "markupsafe", "werkzeug", "quart-trio",
    "pydantic", "pydantic-core", "annotated-types", "typing-extensions", "typing-inspection",
    "prometheus-client", "llguidance", "gguf",
)  # fmt: skip
# What building the binding needs there, at fixed versions: cffi compiles through setuptools on
# Python 3.12, which has no distutils, and a Python 3.12 may come without setuptools (pyenv's does).
BUILD_WHEELS = ("setuptools==80.9.0",)
# The device's Python 3.12 (glibc 2.35 or newer there): pip matches each manylinux tag exactly.
_PLATFORMS = (
    *(f"manylinux_2_{n}_x86_64" for n in range(35, 16, -1)),
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def _keep(rel: pathlib.PurePosixPath) -> bool:
    parts = rel.parts
    if not parts or parts[0] in _SKIP_TOP:
        return False
    if parts[:2] == ("ggml", "src") and len(parts) > 2 and parts[2] in _SKIP_GGML:
        return False
    return not (parts[:2] == ("tools", "ui") and len(parts) > 2 and parts[2] in _SKIP_UI)


def pack_source(target: pathlib.Path) -> list[str]:
    """The pruned tree as ``target`` (xz); the paths packed."""
    names = []
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(SOURCE.rglob("*")):
            rel = pathlib.PurePosixPath(path.relative_to(SOURCE).as_posix())
            if path.is_file() and not path.is_symlink() and _keep(rel):
                tar.add(path, arcname=f"llama.cpp/{rel}", recursive=False)
                names.append(str(rel))
    target.write_bytes(lzma.compress(buf.getvalue(), preset=9 | lzma.PRESET_EXTREME))
    return names


def check_against_build(build_dir: pathlib.Path, packed: set[str]) -> list[str]:
    """Source-tree files that the build's dependency files name but the pack lacks."""
    missing = set()
    root = str(SOURCE.resolve()) + "/"
    for dep in build_dir.rglob("*.d"):
        for token in re.split(r"[\s\\]+", dep.read_text(errors="replace")):
            token = os.path.normpath(token.rstrip(":"))
            if token.startswith(root) and token[len(root) :] not in packed:
                missing.add(token[len(root) :])
    return sorted(missing)


def download_wheels(target: pathlib.Path) -> list[pathlib.Path]:
    """CPython 3.12 wheels of ``WHEELS`` at the versions installed here, and ``BUILD_WHEELS``."""
    target.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS] + list(BUILD_WHEELS)
    platforms = [arg for p in _PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(target), *pins],
        check=True,
    )  # fmt: skip
    return sorted(target.glob("*.whl"))


def tree_bytes() -> int:
    """What the working tree carries besides the payload: tracked and untracked, not ignored."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
    ).stdout
    files = (REPO_ROOT / name for name in out.decode().split("\0") if name)
    return sum(f.stat().st_size for f in files if f.is_file())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check-build", type=pathlib.Path, help="a finished build directory of the same tree")
    args = parser.parse_args(argv)
    subprocess.run([str(REPO_ROOT / "vendor" / "fetch.sh")], check=True)
    shutil.rmtree(PAYLOAD, ignore_errors=True)
    PAYLOAD.mkdir()
    packed = pack_source(PAYLOAD / "llama.cpp.tar.xz")
    print(f"llama.cpp: {len(packed)} files, {(PAYLOAD / 'llama.cpp.tar.xz').stat().st_size / 2**20:.1f} MiB")
    if args.check_build is not None:
        missing = check_against_build(args.check_build, set(packed))
        if missing:
            raise SystemExit(f"the pack lacks files the build read: {missing[:20]}")
        print(f"every file the build in {args.check_build} read is packed")
    wheels = download_wheels(PAYLOAD / "wheels")
    print(f"wheels: {len(wheels)}, {sum(w.stat().st_size for w in wheels) / 2**20:.1f} MiB")
    random_model.save_tokenizer(random_model.default_model(), PAYLOAD / "tokenizer.gguf")
    payload = sum(p.stat().st_size for p in PAYLOAD.rglob("*") if p.is_file())
    total = payload + tree_bytes()
    print(f"payload {payload / 2**20:.1f} MiB, with the working tree {total / 2**20:.1f} MiB (limit 64 MiB)")
    if total > LIMIT_BYTES:
        raise SystemExit("too large for one device call")


if __name__ == "__main__":
    main()
