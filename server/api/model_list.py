"""The model list's wire schema (``GET /v1/models``): OpenAI's model card, with our status,
aliases and the loaded file's own name beside it; and the operators' model actions
(``POST /models/load``, ``/models/unload``). Pydantic only, as ``schema``."""

from __future__ import annotations

from typing import Literal

from server.api.lazy import build_models
from server.api.schema import Out as _Out
from server.api.schema import StrictRequest


class ModelMeta(_Out):
    """Ours, beside OpenAI's fields: what the loaded file says of itself."""

    name: str  # general.name (the file's name without .gguf when it has none)


class ModelStatus(_Out):
    value: Literal["unloaded", "loading", "loaded", "unloading", "failed"]
    progress: float | None = None  # while loading, 0 to 1
    error: str | None = None  # when the last load failed


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int  # when this server process started (a hot restart's new process: later)
    owned_by: str = "llama-trio"
    aliases: list[str] | None = None  # other names a request's ``model`` may use
    tags: list[str] | None = None  # the operator's labels (--tags, a preset's tags)
    status: ModelStatus
    meta: ModelMeta | None = None  # once the model is loaded


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ModelAction(StrictRequest):
    """``POST /models/load`` and ``/models/unload``: the model an operator names."""

    model: str


build_models(globals())
