"""OpenAI's routes: chat completions, completions, embeddings and the model list. Each but
completions also answers without ``/v1``, for clients whose base URL lacks it (llama-server's
``/completions`` is its native format, served by ``native``).

The completion routes go to ``completions.complete``: ``prepare`` validates the body and makes
a ``Job``; the answer holds its sequence inside ``async with engine.submit(job)``, and
Quart-Trio cancels the handler when the client disconnects, which leaves that block and
releases the sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quart import Blueprint, Response, request

from server.api.completions import complete
from server.api.embeddings import embed
from server.api.errors import ApiError
from server.api.lazy import deferred
from server.api.native_embed import native_embeddings
from server.api.preflight import read_object
from server.api.respond import current_state, json_response
from server.models.registry import ModelNotFound

if TYPE_CHECKING:
    from server.api import model_list
    from server.models.registry import ModelRegistry
    from server.models.specs import ModelSpec
else:  # imported once the server is ready (server.api.lazy)
    model_list = deferred("server.api.model_list")

openai = Blueprint("openai", __name__)


@openai.get("/v1/models")
@openai.get("/models")
async def models() -> Response:
    registry = current_state().models
    cards = [_card(registry, spec) for spec in registry.specs]
    return json_response(model_list.ModelList(data=cards).model_dump(exclude_none=True))


@openai.get("/v1/models/<path:name>")
@openai.get("/models/<path:name>")
async def model(name: str) -> Response:
    """OpenAI's retrieve-model call: one model's card, by id or alias."""
    registry = current_state().models
    try:
        spec = registry.resolve(name)
    except ModelNotFound as exc:
        raise ApiError(404, str(exc), param="model", code="model_not_found") from None
    return json_response(_card(registry, spec).model_dump(exclude_none=True))


def _card(registry: ModelRegistry, spec: ModelSpec) -> model_list.ModelCard:
    runtime = registry.runtime(spec.id)
    status = model_list.ModelStatus(value="unloaded")
    meta = None
    if runtime is not None:
        status = model_list.ModelStatus(value=runtime.status)  # type: ignore[arg-type]
        if runtime.status == "loading":
            status.progress = round(runtime.progress, 3)
        elif runtime.failed is not None:
            status.error = runtime.failure
        if runtime.info is not None and runtime.info.name is not None and runtime.engine is not None:
            meta = model_list.ModelMeta(name=runtime.info.name)
    return model_list.ModelCard(
        id=spec.id,
        created=registry.created,
        aliases=list(spec.aliases) or None,
        tags=list(spec.tags) or None,
        status=status,
        meta=meta,
    )


@openai.post("/v1/chat/completions")
@openai.post("/chat/completions")
async def chat_completions() -> Response:
    return await complete(current_state(), chat=True)


@openai.post("/v1/completions")  # "/completions" is llama-server's native format (``native``)
async def completions() -> Response:
    return await complete(current_state(), chat=False)


@openai.post("/v1/embeddings")
@openai.post("/embeddings")
async def embeddings() -> Response:
    """OpenAI's embeddings; a body with llama-server's ``content`` (never OpenAI's field) is
    answered as llama-server's there (``native_embed``, as ``/embedding``: with ``input`` too,
    a 400), its errors in this route's shape."""
    raw = await request.get_data(as_text=False)
    if request.path == "/embeddings" and b'"content"' in raw:
        body = await read_object()
        if body.get("content") is not None:
            return await native_embeddings(current_state(), body, ApiError)
    return await embed(current_state())
