"""``/v1/embeddings``: inputs (strings or token ids) to L2-normalised vectors, as floats or as
base64 of little-endian float32 (what the ``openai`` SDK asks for and decodes)."""

from __future__ import annotations

import base64
import struct
from typing import TYPE_CHECKING, Any, cast

from quart import Response

from server.api.errors import ApiError
from server.api.lazy import deferred
from server.api.preflight import model_lease, off_loop, read_json, refuse_unsupported, resolve, tokenizing
from server.api.respond import FLOAT_CHARS, large_json_response
from server.engine import EngineError
from server.models.registry import Lease
from server.state import ServerState

if TYPE_CHECKING:
    from server.api import schema
else:  # imported once the server is ready (server.api.lazy)
    schema = deferred("server.api.schema")


async def embed(state: ServerState) -> Response:
    """Answer the current ``/v1/embeddings`` request.

    *Cancellation*: the embedder stops between decodes (the client went away; the drain ends
    it with a 503); tokenizing in a worker thread is waited for.
    """
    req: schema.EmbeddingRequest = await read_json(schema.EmbeddingRequest)
    refuse_unsupported(req)
    if not resolve(state, req.model).settings.embeddings:
        raise ApiError(404, "embeddings are off on this server (start it with --embeddings)", code="not_found")
    lease = await model_lease(state, req.model)
    try:
        return await _embed(req, lease)
    finally:
        lease.release()


async def _embed(req: schema.EmbeddingRequest, lease: Lease) -> Response:
    engine, info, embedder = lease.engine, lease.info, lease.runtime.embedder
    assert embedder is not None  # made with the engine when --embeddings
    vocab = engine.vocab
    raw = req.input
    texts: list[str] | None = None
    ids: list[list[int]] = []
    if isinstance(raw, str):
        texts = [raw]
    elif isinstance(raw[0], str):
        texts = cast(list[str], raw)
    elif isinstance(raw[0], int):
        ids = [cast(list[int], raw)]
    else:
        ids = cast(list[list[int]], raw)

    def tokenize(texts: list[str]) -> list[list[int]]:
        return [vocab.tokenize(text, add_special=True, parse_special=False) for text in texts]

    if texts is not None:
        strings = texts
        with tokenizing("input"):
            inputs = await off_loop(sum(len(t) for t in strings), lambda: tokenize(strings))
    else:
        inputs = [list(tokens) for tokens in ids]
    for i, tokens in enumerate(inputs):
        single = isinstance(raw, str) or isinstance(raw[0], int)
        where = "input" if single else f"input[{i}]"
        if not tokens:
            raise ApiError(400, "an input is empty", param=where, code="invalid_value")
        if len(tokens) > embedder.max_tokens:
            message = f"an input is {len(tokens)} tokens; at most {embedder.max_tokens} are embedded"
            raise ApiError(400, message, param=where, code="invalid_value")
        if max(tokens) >= vocab.n_tokens:
            raise ApiError(400, "a token id is not in the vocabulary", param=where, code="invalid_value")
    try:
        vectors = await embedder.embed(inputs)
    except EngineError as exc:  # the drain: before its turn, or at its deadline
        raise ApiError.from_engine(exc) from None
    as_base64 = req.encoding_format == "base64"
    tokens_used = sum(len(t) for t in inputs)
    usage = {"prompt_tokens": tokens_used, "total_tokens": tokens_used}

    def answer() -> dict[str, Any]:
        data = [
            {"object": "embedding", "index": i, "embedding": _base64(v) if as_base64 else v}
            for i, v in enumerate(vectors)
        ]
        return {"object": "list", "data": data, "model": info.id, "usage": usage}

    return await large_json_response(sum(map(len, vectors)) * FLOAT_CHARS, answer)


def _base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
