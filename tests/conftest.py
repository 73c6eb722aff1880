from __future__ import annotations

import pathlib

import pytest

from server.model_files import default_model_path


@pytest.fixture(scope="session")
def model_path() -> pathlib.Path:
    # No skip: a missing model is a broken setup, and the error says how to fix it.
    return default_model_path()


@pytest.fixture(scope="session")
def model(model_path: pathlib.Path):
    import ffi

    m = ffi.Model(model_path)
    yield m
    m.close()


@pytest.fixture(scope="module")
def server():
    """One server for a test module: 4 sequences, small context, the default model."""
    from tests.support.process import serving

    with serving(["--parallel", "4", "--ctx-size", "4096", "--threads", "2"]) as proc:
        yield proc


# -- reliability runs: soak length and fuzzing examples (longer runs: raise them) -------------


def pytest_addoption(parser: pytest.Parser) -> None:
    import os

    group = parser.getgroup("llama-trio reliability")
    group.addoption(
        "--soak-seconds",
        type=float,
        default=float(os.environ.get("LLAMA_TRIO_SOAK_SECONDS", "60")),
        help="how long the soak test sends requests (env LLAMA_TRIO_SOAK_SECONDS; default 60)",
    )
    group.addoption(
        "--fuzz-examples",
        type=int,
        default=int(os.environ.get("LLAMA_TRIO_FUZZ_EXAMPLES", "200")),
        help="hypothesis examples per fuzzed endpoint (env LLAMA_TRIO_FUZZ_EXAMPLES; default 200)",
    )
