"""The checks every route makes before any work, in one place: the body read and validated
(``read_json``), fields this server does not do refused (``refuse_unsupported``), the serving
phase (``ready``: draining, loading or failed is a 503 with ``Retry-After``), and text turned
into tokens with every way it can be bad mapped to a 400 (``tokenizing``, ``off_loop``).

Each dialect (OpenAI chat and completions, embeddings, and the routes that come) parses into
its own request model and then goes through these; none keeps a copy of its own.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import pydantic
import trio
from quart import request

import ffi
from server.api.errors import ApiError, param_from_loc
from server.engine import Engine, ShuttingDown
from server.state import ModelInfo, ServerState

# Bodies larger than this are parsed and validated in a worker thread (json.loads and pydantic
# take about 1 ms per 40 KB here).
INLINE_BODY_BYTES = 32 * 1024
# Work on text runs in a worker thread when it is larger than this, counted in characters of
# text to tokenize (about 0.25 us each here, so about half a millisecond) plus
# ``CHARS_PER_MESSAGE`` per message for a chat template's rendering; smaller work runs inline,
# which saves the thread hand-off's latency.
INLINE_WORK_CHARS = 2_048
CHARS_PER_MESSAGE = 32
MAX_PARAM_NAME = 64  # an unknown field's name, as echoed back in an error

T = TypeVar("T")


async def read_json(model: type[pydantic.BaseModel]) -> Any:
    """The request body validated as ``model``; a 400 naming the first bad field otherwise.
    A large body is parsed in a worker thread.

    *Cancellation*: a parse running in a worker thread is waited for, never abandoned.
    """
    raw = await request.get_data(as_text=False)
    if len(raw) > INLINE_BODY_BYTES:
        return await trio.to_thread.run_sync(_parse, model, raw)
    return _parse(model, raw)


async def read_object() -> dict[str, Any]:
    """The request body as a JSON object, for a dialect that reads its fields itself; a 400
    otherwise. A large body is parsed in a worker thread.

    *Cancellation*: as ``read_json``.
    """
    raw = await request.get_data(as_text=False)
    if len(raw) > INLINE_BODY_BYTES:
        return await trio.to_thread.run_sync(_object, raw)
    return _object(raw)


def _object(raw: str | bytes) -> dict[str, Any]:
    try:
        payload = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return payload


def _parse(model: type[pydantic.BaseModel], raw: str | bytes) -> Any:
    payload = _object(raw)
    try:
        return model.model_validate(payload)
    except pydantic.ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = param_from_loc(tuple(first["loc"]))
        raise ApiError(400, f"{param or 'body'}: {first['msg']}", param=param, code="invalid_value") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply", code="invalid_json") from None


class Refusable(Protocol):
    def unsupported(self) -> str | None: ...


def refuse_unsupported(req: Refusable) -> None:
    """A 400 ``unsupported_parameter`` naming the first field ``req`` sets to something this
    server does not do (its ``unsupported``): never accepted and dropped."""
    refused = req.unsupported()
    if refused is not None:
        name = refused[:MAX_PARAM_NAME]
        raise ApiError(400, f"{name!r} is not supported by this server", param=name, code="unsupported_parameter")


def ready(state: ServerState) -> tuple[Engine, ModelInfo]:
    """The running engine and the loaded model's info, or the 503 that says why not (with
    ``Retry-After``): draining, still loading, or the load failed."""
    if state.draining:
        raise ApiError.from_engine(ShuttingDown("server is shutting down"))
    engine, info = state.engine, state.info
    if state.load_failed is not None:
        raise ApiError.unavailable("the model failed to load", code="model_load_failed")
    if engine is None or info is None:
        raise ApiError.unavailable("the model is still loading", code="model_loading")
    return engine, info


@contextlib.contextmanager
def tokenizing(param: str) -> Iterator[None]:
    """Map what rendering and tokenizing text can raise to a 400 naming ``param``."""
    try:
        yield
    except ffi.TemplateError as exc:
        raise ApiError(400, f"cannot apply the chat template: {exc}", param=param) from None
    except ffi.TokenizeError as exc:
        raise ApiError(400, str(exc), param=param) from None
    except UnicodeEncodeError:  # JSON's "\ud800": a lone surrogate is not text
        problem = "the text contains a lone UTF-16 surrogate (invalid Unicode)"
        raise ApiError(400, problem, param=param, code="invalid_value") from None


async def off_loop(work: int, fn: Callable[[], T]) -> T:
    """``fn()``, in a worker thread when ``work`` (characters, see ``INLINE_WORK_CHARS``) is
    large, inline otherwise.

    *Cancellation*: a call running in a worker thread (it may hold the vocabulary) is waited
    for, never abandoned.
    """
    if work > INLINE_WORK_CHARS:
        return await trio.to_thread.run_sync(fn)
    return fn()
