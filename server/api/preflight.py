"""The checks every route makes before any work, in one place: the body read and validated
(``read_json``), fields this server does not do refused (``refuse_unsupported``), the serving
phase (``model_lease``: the model a request names, loaded on demand; draining, loading or failed
is a 503 with ``Retry-After``), and text turned
into tokens with every way it can be bad mapped to a 400 (``tokenizing``, ``off_loop``).

Each dialect (OpenAI chat and completions, embeddings, and the routes that come) parses into
its own request model and then goes through these; none keeps a copy of its own.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import trio
from quart import request

import ffi
from server.api.errors import ApiError, param_from_loc
from server.engine import ShuttingDown
from server.models.registry import Lease, ModelNotFound, ModelUnavailable
from server.models.specs import ModelSpec
from server.state import ServerState

if TYPE_CHECKING:
    import pydantic

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
# Objects and arrays nested in one another: far past any API's need (a schema's own bound is 128
# levels), and far inside the recursion that the event loop's thread allows what walks a body.
MAX_BODY_DEPTH = 256
# A UTF-16 surrogate left in a parsed string: JSON's "\ud800" escape without its pair (a valid
# pair is joined into one character by the parser), which is not Unicode text.
_SURROGATE = re.compile("[\ud800-\udfff]")

T = TypeVar("T")
M = TypeVar("M", bound="pydantic.BaseModel")


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
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        message = f"request body is nested too deeply (more than {MAX_BODY_DEPTH} levels)"
        raise ApiError(400, message, code="invalid_json") from None
    if not isinstance(payload, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    _check_values(payload)
    return payload


def _parse(model: type[pydantic.BaseModel], raw: str | bytes) -> Any:
    return validate(model, _object(raw))


def validate(model: type[M], payload: Any, at: str = "") -> M:
    """``payload`` validated as ``model``; a 400 naming the first bad field otherwise (under
    ``at``, the field ``payload`` came from, when it is part of a request)."""
    from pydantic import ValidationError  # imported with ``model``'s module (server.api.lazy)

    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = param_from_loc(tuple(first["loc"]))
        if at:
            param = at + ("" if param is None else param if param.startswith("[") else "." + param)
        raise ApiError(400, f"{param or 'body'}: {first['msg']}", param=param, code="invalid_value") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply", code="invalid_json") from None


def _check_values(payload: dict[str, Any]) -> None:
    """Refuse (400) a body whose containers nest past ``MAX_BODY_DEPTH``, or with a string (or
    object key) holding a lone surrogate, named by its field path (``messages[0].content``):
    every field of every route is checked here, before any of it is used. A body parsed in a
    worker thread (a fresh stack) can nest deeper than the event loop's recursion allows, so
    the depth bound keeps every recursive walk after it (schemas, ``json.dumps``) in bounds."""
    stack: list[tuple[Any, str, int]] = [(payload, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                raise _lone_surrogate(path)
            continue
        if depth > MAX_BODY_DEPTH:
            message = (
                f"request body is nested too deeply (more than {MAX_BODY_DEPTH} levels, at {path[:MAX_PARAM_NAME]})"
            )
            raise ApiError(400, message, code="invalid_json")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        children = []
        for key, child in items:
            step = _step(path, key)
            if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                raise _lone_surrogate(step)
            if isinstance(child, str | dict | list):
                children.append((child, step, depth + 1))
        stack.extend(reversed(children))


def _lone_surrogate(path: str) -> ApiError:
    message = f"{path}: the text contains a lone UTF-16 surrogate (invalid Unicode)"
    return ApiError(400, message, param=path[:MAX_PARAM_NAME], code="invalid_value")


def _step(path: str, key: str | int) -> str:
    """``path`` one level down: ``[0]``, ``.name``, or a quoted key that is no identifier."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if key.isidentifier():
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(key)}]"


class Refusable(Protocol):
    def unsupported(self) -> str | None: ...


def refuse_unsupported(req: Refusable) -> None:
    """A 400 ``unsupported_parameter`` naming the first field ``req`` sets to something this
    server does not do (its ``unsupported``): never accepted and dropped."""
    refused = req.unsupported()
    if refused is not None:
        name = refused[:MAX_PARAM_NAME]
        raise ApiError(400, f"{name!r} is not supported by this server", param=name, code="unsupported_parameter")


async def model_lease(state: ServerState, name: str | None) -> Lease:
    """A lease on the model a request names (its ``model``), loaded on demand; or the answer
    that says why not: 404 ``model_not_found``, or a 503 with ``Retry-After`` (draining, still
    starting, the model's load failed or took too long, no room to load it).

    The caller releases the lease when its answer ends (``Lease.release``).

    *Cancellation*: the wait for a load ends; the load goes on for other requests.
    """
    if state.draining:
        raise ApiError.from_engine(ShuttingDown("server is shutting down"))
    if state.load_failed is not None:
        raise ApiError.unavailable("the model failed to load", code="model_load_failed")
    if not state.ready.is_set():  # starting: /health says so too; a proxy retries elsewhere
        raise ApiError.unavailable("the model is still loading", code="model_loading")
    try:
        return await state.models.acquire(resolve(state, name).id)
    except ModelUnavailable as exc:
        if not exc.retry:  # no Retry-After: asking again cannot help
            raise ApiError(503, str(exc), type_="server_error", code=exc.code) from None
        raise ApiError.unavailable(str(exc), code=exc.code) from None


@contextlib.asynccontextmanager
async def leased(state: ServerState, name: str | None) -> AsyncIterator[Lease]:
    """``model_lease`` for the span of a block (a route that answers within it)."""
    lease = await model_lease(state, name)
    try:
        yield lease
    finally:
        lease.release()


def model_name(value: Any, param: str = "model") -> str | None:
    """A ``model`` taken from a body or query that no schema checked: a string or absent."""
    if value is None or isinstance(value, str):
        return value
    raise ApiError(400, f"{param} must be a string (a model id)", param=param, code="invalid_value")


def resolve(state: ServerState, name: str | None) -> ModelSpec:
    """The model a request names (by id or alias), or a 404 ``model_not_found``."""
    try:
        return state.models.resolve(name)
    except ModelNotFound as exc:
        raise ApiError(404, str(exc), param="model", code="model_not_found") from None


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
