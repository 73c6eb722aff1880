"""llama-server's own embeddings (``/embedding``, and ``/embeddings`` given ``content``): its
input shapes and answer, not OpenAI's.

The input is ``input`` or ``content``, one of them (llama-server takes ``input`` when both are
given, and drops ``content``; here that is a 400): a string, token ids, or a list whose items
are each a string, token ids, or token ids and strings mixed (text parsed for special tokens,
as the native family does). Other fields (``dimensions``, ``pooling``) are refused, never
dropped. The answer is a JSON array with one ``{"index", "embedding"}`` per input,
``embedding`` being a list that holds the pooled vector, normalised as ``embd_normalize`` says
(llama.cpp's: -1 none, 0 the int16 range, 1 taxicab, 2 Euclidean, the default, p > 2 p-norm).
"""

from __future__ import annotations

from typing import Any

from quart import Response

from server.api.errors import ApiError
from server.api.native_prompt import mixed, text_work
from server.api.native_schema import NativeError, refuse_unknown
from server.api.preflight import model_lease, model_name, off_loop, resolve, tokenizing
from server.api.respond import FLOAT_CHARS, large_json_response
from server.engine import EngineError
from server.state import ServerState

MAX_INPUTS = 256  # as /v1/embeddings
# llama-server's fields here, and ``model``: another (``dimensions``, ``pooling``) is refused.
FIELDS = frozenset({"input", "content", "embd_normalize", "encoding_format", "model"})
MAX_NORM = 2**31 - 1  # embd_normalize is a C int in llama-server


async def native_embeddings(state: ServerState, body: dict[str, Any], error: type[ApiError]) -> Response:
    """Answer llama-server's embeddings request ``body``; problems are ``error``s (the route's
    family's shape).

    *Cancellation*: as ``/v1/embeddings``: the embedder stops between decodes; tokenizing in a
    worker thread is waited for.
    """
    try:
        refuse_unknown(body, FIELDS)
    except NativeError as exc:
        raise error(400, str(exc), param=exc.param, code="unsupported_parameter") from None
    name = model_name(body.get("model"))
    if not resolve(state, name).settings.embeddings:
        raise error(404, "embeddings are off on this server (start it with --embeddings)", code="not_found")
    given = [field for field in ("input", "content") if body.get(field) is not None]
    if len(given) != 1:
        message = '"input" or "content" must be given' if not given else 'give "input" or "content", not both'
        raise error(400, message, param="input", code="invalid_value")
    (param,) = given
    norm = body.get("embd_normalize", 2)
    if isinstance(norm, bool) or not isinstance(norm, int) or not -1 <= norm <= MAX_NORM:
        message = "embd_normalize: -1 (none), 0 (int16 range), 1 (taxicab), 2 (Euclidean) or a larger p-norm"
        raise error(400, message, param="embd_normalize", code="invalid_value")
    if body.get("encoding_format", "float") != "float":  # llama-server ignores it here: refused, not dropped
        message = "encoding_format: this route answers floats (base64 is for /v1/embeddings)"
        raise error(400, message, param="encoding_format", code="invalid_value")
    value = body[param]
    work = text_work(value)  # a walk that stops early: ``value`` may hold millions of ids
    entries = await off_loop(work, lambda: _entries(value, param, error))
    lease = await model_lease(state, name)
    try:
        embedder, vocab = lease.runtime.embedder, lease.engine.vocab
        assert embedder is not None  # made with the engine when --embeddings

        def tokenize() -> list[list[int]]:
            out = []
            for where, entry in entries:
                try:  # as the native family reads ids and text in one sequence
                    tokens = mixed([entry] if isinstance(entry, str) else entry, vocab, where)
                except NativeError as exc:
                    raise error(400, f"{where}: {exc}", param=where, code="invalid_value") from None
                if not tokens:
                    raise error(400, f"{where}: an input is empty", param=where, code="invalid_value")
                if len(tokens) > embedder.max_tokens:
                    message = f"{where}: an input is {len(tokens)} tokens; at most {embedder.max_tokens} are embedded"
                    raise error(400, message, param=where, code="invalid_value")
                out.append(tokens)
            return out

        with tokenizing(param):
            inputs = await off_loop(work, tokenize)
        try:
            vectors = await embedder.embed(inputs, norm)
        except EngineError as exc:  # the drain
            raise error.from_engine(exc) from None
    finally:
        lease.release()
    return await large_json_response(
        sum(map(len, vectors)) * FLOAT_CHARS,
        lambda: [{"index": i, "embedding": [vector]} for i, vector in enumerate(vectors)],
    )


def _entries(value: Any, param: str, error: type[ApiError]) -> list[tuple[str, str | list[int | str]]]:
    """The inputs of ``value`` as llama-server reads them, each with the field path that names
    it: a string or token ids (mixed with strings) is one input; a list of those, one each."""
    if _one(value):
        return [(param, value)]
    if not isinstance(value, list) or not value:
        raise error(400, f"{param} must be a string, token ids, or a list of those", param=param, code="invalid_value")
    if len(value) > MAX_INPUTS:
        raise error(400, f"{param}: at most {MAX_INPUTS} inputs", param=param, code="invalid_value")
    entries = []
    for i, entry in enumerate(value):
        if not _one(entry):
            message = f"{param}[{i}] must be a string or token ids (mixed with strings)"
            raise error(400, message, param=f"{param}[{i}]", code="invalid_value")
        entries.append((f"{param}[{i}]", entry))
    return entries


def _one(value: Any) -> bool:
    """One input: a string, or a non-empty list of token ids and strings with an id in it."""
    if isinstance(value, str):
        return True
    return (
        isinstance(value, list)
        and any(_id(part) for part in value)
        and all(_id(part) or isinstance(part, str) for part in value)
    )


def _id(part: Any) -> bool:
    return isinstance(part, int) and not isinstance(part, bool)
