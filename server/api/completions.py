"""The two completion endpoints' shared handler: prepare the job, then answer it whole
(non-streamed, here) or as Server-Sent Events (``streaming``)."""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING, Any

from quart import Response, request

from server.api import logprobs, native_render, sse
from server.api.collect import Collected, collect
from server.api.errors import ApiError
from server.api.lazy import deferred
from server.api.openai_stream import OpenAIStream
from server.api.prepare import Prepared, prepare
from server.api.respond import json_response
from server.api.streaming import streamed_response
from server.api.tools import call_id, read_answer
from server.api.trace import Trace, merged_usage, usage_payload
from server.state import ServerState

if TYPE_CHECKING:
    from server.api import schema
else:  # imported once the server is ready (server.api.lazy)
    schema = deferred("server.api.schema")


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
    model = prepared.model
    if prepared.stream:
        framer = sse.ChunkFramer(
            chat=chat,
            id_=id_,
            created=created,
            model=model.id,
            fingerprint=model.fingerprint,
            include_usage=prepared.include_usage,
        )
        return streamed_response(prepared, OpenAIStream(prepared, framer), trace, state.settings.ping_interval)
    choices = await collect(prepared, trace)
    merged = merged_usage([c.usage for c in choices if c.usage])
    usage = schema.UsageInfo.model_validate(usage_payload(merged))
    head: dict[str, Any] = {"id": id_, "created": created, "model": model.id, "system_fingerprint": model.fingerprint}
    # llama-server's ``timings`` beside OpenAI's fields (its tools and web UI read them).
    timing = native_render.Timing(
        None if trace.first is None else trace.first - trace.start,
        None if trace.last is None else trace.last - trace.start,
    )
    timings = native_render.timings(merged, timing, usage.completion_tokens)
    vocab = prepared.engine.vocab
    if chat:
        return json_response({**_chat_completion(head, choices, usage, prepared, vocab), "timings": timings})
    completion_choices = [
        schema.CompletionChoice(
            index=index,
            text=choice.text,
            finish_reason=choice.finish,
            logprobs=logprobs.completion_whole(choice.logprobs, vocab) if prepared.logprobs else None,
        )
        for index, choice in enumerate(choices)
    ]
    completion = schema.Completion(**head, choices=completion_choices, usage=usage).model_dump()
    return json_response({**completion, "timings": timings})


def _chat_completion(
    head: dict[str, Any],
    choices: list[Collected],
    usage: schema.UsageInfo,
    prepared: Prepared,
    vocab: logprobs.Vocabulary,
) -> dict[str, Any]:
    chat_choices = []
    for index, choice in enumerate(choices):
        message, finish = _assistant_message(choice.text, choice.finish, tools=prepared.tools)
        chat_logprobs = None
        if prepared.logprobs:
            content = logprobs.chat_content(choice.logprobs, vocab)
            chat_logprobs = {"content": content, "refusal": None}
        choice_out = schema.ChatChoice(index=index, message=message, finish_reason=finish, logprobs=chat_logprobs)
        chat_choices.append(choice_out)
    payload = schema.ChatCompletion(**head, choices=chat_choices, usage=usage).model_dump()
    for entry, chat_choice in zip(payload["choices"], chat_choices, strict=True):
        if chat_choice.message.tool_calls is None:
            del entry["message"]["tool_calls"]
    return payload


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
