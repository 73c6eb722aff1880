from __future__ import annotations

import os
import pathlib
import shutil
import sys
import tempfile

import pytest

from server.model_files import DEFAULT_MODEL_PACKAGE, default_model_path
from tests.support import needs

# The shared fixtures that need something a marker names: a test that uses one (directly or
# through other fixtures) gets the marker.
FIXTURE_MARKERS = {"model_path": "model", "model": "model", "tiny_model_path": "model", "server": "server"}


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


@pytest.fixture(scope="session")
def tiny_model_path(model_path: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A random-weight llama, 64 wide and 2 layers, with the default model's tokenizer and chat
    template (``bench/random_model.py``): for tests whose prompts are long and whose answers'
    words do not matter (its prefill is about 100x the default model's)."""
    from bench.random_model import SHAPES, write_model

    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_model(model_path, path, SHAPES["tiny"], seed=0)
    return path


@pytest.fixture(scope="module")
def server():
    """One server for a test module: 4 sequences, small context, the default model."""
    from tests.support.process import serving

    with serving(["--parallel", "4", "--ctx-size", "4096", "--threads", "2"]) as proc:
        yield proc


# -- markers: what a test needs (tests/support/needs.py) ---------------------------------------


def pytest_itemcollected(item: pytest.Item) -> None:
    for name in getattr(item, "fixturenames", ()):
        marker = FIXTURE_MARKERS.get(name)
        if marker is not None:
            item.add_marker(marker)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    needs.running(marker.name for marker in item.iter_markers())


def hide_model(directory: pathlib.Path) -> None:
    """Make the default model unfindable, as if its wheel were not installed, for this process
    and the processes it starts: a stand-in package without the model file, first on the
    import path (``server/model_files.py`` finds the model through that package)."""
    package = directory / DEFAULT_MODEL_PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    sys.path.insert(0, str(directory))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))
    sys.modules.pop(DEFAULT_MODEL_PACKAGE, None)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("hide_model"):
        directory = pathlib.Path(tempfile.mkdtemp(prefix="llama-trio-no-model-"))
        hide_model(directory)
        config.add_cleanup(lambda: shutil.rmtree(directory, ignore_errors=True))


# -- options: soak length and fuzzing examples (longer runs: raise them); --hide-model --------


def pytest_addoption(parser: pytest.Parser) -> None:
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
    parser.getgroup("llama-trio markers").addoption(
        "--hide-model",
        action="store_true",
        help="run as if the default model were not installed (make test-unit: proves the tests it runs need no model)",
    )
