"""OpenAI's Responses API: ``POST /v1/responses`` (also ``/responses``), its store
(``GET``/``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``) and
``POST /v1/responses/input_tokens``.

A request is parsed (``responses_parse``) into the internal request, which goes the one way
every request goes (``prepare.prepare_request``), then is answered whole
(``collect``, rendered by ``responses_render``) or streamed (``streaming`` over
``responses_stream.ResponsesStream``). With ``store`` (the default, as OpenAI's) the response
and the conversation that led to it are kept (``server/store.py``, scoped by API key) before
its client can read that it is done, so ``previous_response_id`` can continue it at once.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from quart import Blueprint, Response, request

from server.api.collect import collect
from server.api.errors import ApiError
from server.api.preflight import read_json, refuse_unsupported
from server.api.prepare import Prepared, prepare_request, prompt_tokens
from server.api.respond import current_state, json_response, tenant
from server.api.streaming import streamed_response
from server.api.trace import Trace
from server.state import ServerState
from server.store import ResponseStore, Stored, StoreError

if TYPE_CHECKING:
    from server.api import responses_parse as parse
    from server.api import responses_render as render
    from server.api import responses_stream as stream
else:  # imported by the family's first request (server.api.lazy)
    from server.api.lazy import deferred

    parse = deferred("server.api.responses_parse", warm=False)
    render = deferred("server.api.responses_render", warm=False)
    stream = deferred("server.api.responses_stream", warm=False)

responses = Blueprint("responses", __name__)
logger = logging.getLogger("llama_trio.api")

MAX_LIST_LIMIT = 100  # input_items' page, as OpenAI
DEFAULT_LIST_LIMIT = 20
T = TypeVar("T")


@responses.post("/v1/responses")
@responses.post("/responses")
async def create() -> Response:
    """Answer a Responses request.

    *Cancellation*: as chat's (``completions.complete``); a response whose client went away
    before it was done is not stored.
    """
    state = current_state()
    trace = Trace(state, request.path)
    try:
        req, context, prepared = await _prepare(state)
    except ApiError as exc:
        trace.status, trace.ending = exc.status, exc.code or "error"
        trace.log()
        raise
    head = render.head(req, parse.new_id("resp"), prepared.model.id)
    owner = tenant()
    # The answer's "store" says whether it was kept (too large for the store: not).
    keep = _keeper(state.responses, owner, head["id"], context) if req.stored else None

    def ended() -> None:  # a delete while it was being made is forgotten with it
        state.responses.end(owner, head["id"])

    if prepared.stream:
        dialect = stream.ResponsesStream(prepared, head)

        async def before_closing() -> Sequence[bytes] | None:
            if keep is not None and dialect.final is not None and not await _kept(keep, dialect.final, head["id"]):
                return dialect.closing_unstored()
            return None

        return streamed_response(
            prepared, dialect, trace, state.settings.ping_interval, before_closing=before_closing, on_end=ended
        )
    try:
        choice = (await collect(prepared, trace))[0]
        output = render.whole_output(choice.text, choice.finish, prepared.tools)
        answer = render.response(head, render.status_of(choice.finish), output, choice.usage)
        if keep is not None and not await _kept(keep, answer, head["id"]):
            answer["store"] = False
    finally:
        ended()
    return json_response(answer)


async def _prepare(state: ServerState) -> tuple[parse.ResponsesRequest, list[dict[str, Any]], Prepared]:
    """The request, its context (a continued conversation's items, then its own) and its job."""
    req = await read_json(parse.ResponsesRequest)
    refuse_unsupported(req)
    context = await _context(state.responses, req)
    internal = parse.internal_request(req, context)
    try:
        prepared = await prepare_request(state, internal)
    except ApiError as exc:
        raise exc.renamed(parse.PARAM_NAMES) from None
    return req, context, prepared


async def _context(store: ResponseStore, req: parse.ResponsesRequest) -> list[dict[str, Any]]:
    """The items the model sees: with ``previous_response_id``, that response's context and
    output first (its instructions are not carried over, as with OpenAI)."""
    own = parse.input_items(req)
    earlier: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = await _stored(lambda: store.get(tenant(), req.previous_response_id or ""))
        if stored is None:
            message = f"no stored response {req.previous_response_id!r}"
            raise ApiError(404, message, param="previous_response_id", code="not_found")
        earlier = [*stored.context, *render.context_of(stored.response)]
    parse.refuse_duplicate_ids(earlier, own)
    return [*earlier, *own]


def _keeper(
    store: ResponseStore, owner: str, id_: str, context: list[dict[str, Any]]
) -> Callable[[dict[str, Any]], Awaitable[bool]]:
    """What stores the answer to the current request in its tenant (``owner``); from now on a
    delete of ``id_`` is kept (``ResponseStore.begin``) until the request ``end``s it."""
    store.begin(owner, id_)

    async def keep(answer: dict[str, Any]) -> bool:
        """False when it was not kept: too large for the store (logged), or deleted meanwhile."""
        return await _stored(lambda: store.put(owner, id_, answer, context))

    return keep


async def _kept(keep: Callable[[dict[str, Any]], Awaitable[bool]], answer: dict[str, Any], id_: str) -> bool:
    """Whether ``answer`` was stored; a store that fails (not open, locked, full, corrupt)
    leaves it unstored, never lost: the client gets it, with ``store: false``."""
    try:
        return await keep(answer)
    except ApiError as exc:
        logger.warning("response %s not stored: %s", id_, exc.message)
        return False


async def _stored(call: Callable[[], Awaitable[T]]) -> T:
    """A store call; a store not open (the server is starting or stopping) is a 503."""
    try:
        return await call()
    except StoreError as exc:
        raise ApiError.unavailable(str(exc), code="store_unavailable") from None


@responses.post("/v1/responses/input_tokens")
@responses.post("/responses/input_tokens")
async def input_tokens() -> Response:
    state = current_state()
    req = await read_json(parse.ResponsesRequest)
    refuse_unsupported(req)
    context = await _context(state.responses, req)
    internal = parse.internal_request(req, context)
    try:
        count = await prompt_tokens(state, internal)
    except ApiError as exc:
        raise exc.renamed(parse.PARAM_NAMES) from None
    return json_response({"object": "response.input_tokens", "input_tokens": count})


@responses.get("/v1/responses/<id_>")
@responses.get("/responses/<id_>")
async def retrieve(id_: str) -> Response:
    _refuse_query("include", "stream", "starting_after")
    return json_response((await _find(id_)).response)


@responses.delete("/v1/responses/<id_>")
@responses.delete("/responses/<id_>")
async def delete(id_: str) -> Response:
    store = current_state().responses
    if not await _stored(lambda: store.delete(tenant(), id_)):
        raise _not_found(id_)
    return json_response({"id": id_, "object": "response.deleted", "deleted": True})


@responses.get("/v1/responses/<id_>/input_items")
@responses.get("/responses/<id_>/input_items")
async def list_input_items(id_: str) -> Response:
    """The items the response was made from (a continued conversation's included), in pages:
    ``order`` (desc by default), ``after`` (an item id) and ``limit`` (1 to 100, 20)."""
    _refuse_query("include")
    args = request.args
    order = args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be 'asc' or 'desc'", param="order", code="invalid_value")
    limit_text = args.get("limit", str(DEFAULT_LIST_LIMIT))
    if not (limit_text.isascii() and limit_text.isdigit()) or not 1 <= int(limit_text) <= MAX_LIST_LIMIT:
        message = f"limit must be an integer from 1 to {MAX_LIST_LIMIT}"
        raise ApiError(400, message, param="limit", code="invalid_value")
    items = (await _find(id_)).context
    if order == "desc":
        items = items[::-1]
    after = args.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(400, f"no input item {after!r} in this response", param="after", code="invalid_value")
        items = items[ids.index(after) + 1 :]
    page = items[: int(limit_text)]
    return json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        }
    )


async def _find(id_: str) -> Stored:
    store = current_state().responses
    stored = await _stored(lambda: store.get(tenant(), id_))
    if stored is None:
        raise _not_found(id_)
    return stored


def _not_found(id_: str) -> ApiError:
    return ApiError(404, f"no stored response {id_!r}", param="response_id", code="not_found")


# A query parameter's name, also in the list forms clients send (``include[]``, ``include[0]``:
# OpenAI's SDK writes lists so).
_QUERY_NAME = re.compile(r"(?P<name>[^\[]+)(?:\[\d*\])?")


def _refuse_query(*names: str) -> None:
    """A 400 for a query parameter this server does not do (``include`` is allowed empty)."""
    for key, value in request.args.items(multi=True):
        match = _QUERY_NAME.fullmatch(key)
        name = match["name"] if match else key
        if name in names and value and not (name == "stream" and value == "false"):
            raise ApiError(400, f"{name!r} is not supported by this server", param=name, code="unsupported_parameter")
