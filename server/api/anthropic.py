"""Anthropic's Messages API: ``POST /v1/messages`` (also ``/messages``) and
``POST /v1/messages/count_tokens``.

A request is parsed (``anthropic_parse``) into the internal request, which goes the one way
every request goes (``prepare.prepare_request``), then is answered whole (``collect``, rendered
by ``anthropic_render``) or streamed (``streaming`` over ``anthropic_stream.AnthropicStream``).
Every error on these routes, a missing API key's included, is answered in Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``). The SDK's ``x-api-key``,
``anthropic-version`` and ``anthropic-beta`` headers are taken as they come: the key as any
key (``middleware``), the version and betas as information (they select nothing here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quart import Blueprint, Response, request
from werkzeug.exceptions import MethodNotAllowed, NotFound

from server.api.collect import collect
from server.api.errors import ApiError
from server.api.middleware import as_api_error
from server.api.preflight import read_json, refuse_unsupported
from server.api.prepare import prepare_request, prompt_tokens
from server.api.respond import current_state, json_response
from server.api.streaming import streamed_response
from server.api.trace import Trace

if TYPE_CHECKING:
    from server.api import anthropic_parse as parse
    from server.api import anthropic_render as render
    from server.api import anthropic_stream as stream
else:  # imported by the family's first request (server.api.lazy)
    from server.api.lazy import deferred

    parse = deferred("server.api.anthropic_parse", warm=False)
    render = deferred("server.api.anthropic_render", warm=False)
    stream = deferred("server.api.anthropic_stream", warm=False)

anthropic = Blueprint("anthropic", __name__)


@anthropic.errorhandler(Exception)
async def anthropic_error(exc: Exception) -> Response:
    """Whatever a route here raised (an ``ApiError``, an HTTP error such as 413, a bug's 500),
    in Anthropic's shape, with the same status and headers as elsewhere."""
    error = as_api_error(exc, current_state().settings.max_body)
    response = json_response(render.error_body(error), error.status)
    response.headers.update(error.headers)
    return response


@anthropic.post("/v1/messages")
@anthropic.post("/messages")
async def messages() -> Response:
    """Answer a Messages request.

    *Cancellation*: as chat's (``completions.complete``).
    """
    state = current_state()
    trace = Trace(state, request.path)
    try:
        req = await read_json(parse.MessagesRequest)
        refuse_unsupported(req)
        internal = parse.internal_request(req)
        try:
            prepared = await prepare_request(state, internal)
        except ApiError as exc:
            raise exc.renamed(parse.PARAM_NAMES) from None
    except ApiError as exc:
        trace.status, trace.ending = exc.status, exc.code or "error"
        trace.log()
        raise
    id_ = render.message_id()
    if prepared.stream:
        dialect = stream.AnthropicStream(prepared, id_)
        return streamed_response(prepared, dialect, trace, state.settings.ping_interval)
    choice = (await collect(prepared, trace))[0]
    content, called = render.whole_content(choice.text, prepared.tools)
    stop = render.stop_reason(choice.finish, choice.stop_sequence, called=called)
    return json_response(render.message(id_, prepared.model.id, content, stop, choice.usage))


@anthropic.post("/v1/messages/count_tokens")
@anthropic.post("/messages/count_tokens")
async def count_tokens() -> Response:
    """The prompt's tokens, as ``/v1/messages`` would build it, without generating."""
    state = current_state()
    req = await read_json(parse.CountTokensRequest)
    refuse_unsupported(req)
    internal = parse.internal_request(req)
    try:
        count = await prompt_tokens(state, internal)
    except ApiError as exc:
        raise exc.renamed(parse.PARAM_NAMES) from None
    return json_response({"input_tokens": count})


OTHER_METHODS = ["GET", "PUT", "PATCH", "DELETE"]
ALL_METHODS = [*OTHER_METHODS, "POST", "OPTIONS"]


@anthropic.route("/v1/messages", methods=OTHER_METHODS, provide_automatic_options=False)
@anthropic.route("/messages", methods=OTHER_METHODS, provide_automatic_options=False)
@anthropic.route("/v1/messages/count_tokens", methods=OTHER_METHODS, provide_automatic_options=False)
@anthropic.route("/messages/count_tokens", methods=OTHER_METHODS, provide_automatic_options=False)
async def wrong_method() -> Response:
    """A 405 on these paths, in Anthropic's shape (routing's own would be the app's). Its
    routes add no OPTIONS of their own, so that OPTIONS answers with the methods there are."""
    raise MethodNotAllowed(valid_methods=["OPTIONS", "POST"])


@anthropic.route("/v1/messages/<path:_rest>", methods=ALL_METHODS, provide_automatic_options=False)
@anthropic.route("/messages/<path:_rest>", methods=ALL_METHODS, provide_automatic_options=False)
async def no_route(_rest: str) -> Response:
    """A 404 under the family's paths, in Anthropic's shape (routing's own would be the app's):
    an SDK pointed at a path this server lacks reads its error as it reads Anthropic's."""
    raise NotFound()
