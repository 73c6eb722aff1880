"""The two completion endpoints' shared handler: prepare the job, then answer it whole
(non-streamed, here) or as Server-Sent Events (``streaming``)."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from quart import Response, request

from server.api import logprobs, schema, sse
from server.api.errors import ApiError
from server.api.prepare import prepare
from server.api.streaming import streamed_response
from server.api.tools import call_id, read_answer
from server.api.trace import Trace, usage_payload
from server.engine import EngineError, TokenLogprob
from server.state import ServerState


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(json.dumps(payload, ensure_ascii=False), status=status, content_type="application/json")


async def complete(state: ServerState, *, chat: bool) -> Response:
    """Answer the current request on ``/v1/chat/completions`` (``chat``) or ``/v1/completions``.

    *Cancellation*: a non-streamed answer in progress releases its job when cancelled (the
    client went away); a streamed one submits its job only when Quart sends its body.
    """
    trace = Trace(state, request.path)
    try:
        prepared = await prepare(state, chat=chat)
    except ApiError as exc:
        trace.status, trace.ending = exc.status, exc.code or "error"
        trace.log()
        raise
    id_ = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    created = int(time.time())
    engine = state.engine
    assert engine is not None
    if prepared.stream:
        framer = sse.ChunkFramer(
            chat=chat, id_=id_, created=created, model=state.model_id, fingerprint=state.fingerprint
        )
        return streamed_response(engine, prepared, framer, trace, state.settings.ping_interval)
    texts: list[str] = []
    token_logprobs: list[TokenLogprob] = []
    pieces_logprobs: list[tuple[tuple[TokenLogprob, ...], str]] = []
    try:
        async with engine.submit(prepared.job) as pieces:
            async for piece in pieces:
                trace.piece(piece)
                texts.append(piece.text)
                token_logprobs += piece.logprobs
                pieces_logprobs.append((piece.logprobs, piece.text))
    except EngineError as exc:
        trace.status, trace.ending = exc.status, exc.code
        trace.log()
        raise ApiError.from_engine(exc, param=prepared.prompt_param) from None
    except BaseException:
        trace.log()  # cancelled: the client went away
        raise
    trace.log()
    usage = trace.usage
    assert usage is not None
    text = "".join(texts)
    usage_info = schema.UsageInfo.model_validate(usage_payload(usage))
    payload: dict[str, Any]
    token_bytes = engine.vocab.piece
    if chat:
        message, finish = _assistant_message(text, trace.ending, tools=prepared.tools)
        chat_logprobs = None
        if prepared.logprobs:
            chat_logprobs = {"content": logprobs.chat_content(token_logprobs, token_bytes), "refusal": None}
        payload = schema.ChatCompletion(
            id=id_,
            created=created,
            model=state.model_id,
            system_fingerprint=state.fingerprint,
            choices=[schema.ChatChoice(message=message, finish_reason=finish, logprobs=chat_logprobs)],
            usage=usage_info,
        ).model_dump()
        if message.tool_calls is None:
            del payload["choices"][0]["message"]["tool_calls"]
    else:
        payload = schema.Completion(
            id=id_,
            created=created,
            model=state.model_id,
            system_fingerprint=state.fingerprint,
            choices=[
                schema.CompletionChoice(
                    text=text,
                    finish_reason=trace.ending,
                    logprobs=logprobs.completion_whole(pieces_logprobs, token_bytes) if prepared.logprobs else None,
                )
            ],
            usage=usage_info,
        ).model_dump()
    return json_response(payload)


def _assistant_message(text: str, finish: str, *, tools: str | None) -> tuple[schema.AssistantMessage, str]:
    """The answer as OpenAI's assistant message, and its finish reason: with tools, the
    response's text or the calls (then ``"tool_calls"`` where the answer ended by itself)."""
    if not tools:
        return schema.AssistantMessage(content=text), finish
    answer = read_answer(text, native=tools == "native")
    if not answer.calls:
        return schema.AssistantMessage(content=answer.content), finish
    calls = [
        schema.ToolCallOut(id=call_id(), function=schema.FunctionCallOut(name=name, arguments=arguments))
        for name, arguments in answer.calls
    ]
    return schema.AssistantMessage(content=None, tool_calls=calls), "tool_calls" if finish == "stop" else finish
