"""Anthropic's Messages stream as a ``StreamDialect``: named events. ``message_start`` (the
message without content, input tokens counted), then each content block as
``content_block_start``, ``content_block_delta`` (``text_delta``, or ``input_json_delta`` for a
``tool_use`` block's input) and ``content_block_stop``; then ``message_delta`` (stop reason
and usage) and ``message_stop``. ``ping`` while silent; an error (the drain's cut among them)
as an ``error`` event, which ends the stream.

A plain answer's text block is opened before the job runs, so every text delta after it is the
same bytes around its text: those take the direct path (``direct_text``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from server.api import sse, tools
from server.api.anthropic_render import error_body, message, stop_reason, tool_use_id, usage_object
from server.api.errors import ApiError
from server.api.prepare import Prepared
from server.engine import Piece, Usage

PING = sse.named_event("ping", {"type": "ping"})


class AnthropicStream:
    """The events of one Messages stream for ``prepared``, as message ``id_``."""

    ping = PING

    def __init__(self, prepared: Prepared, id_: str) -> None:
        self._prepared = prepared
        self._id = id_
        self._blocks = 0  # content blocks begun
        self._open: str | None = None  # the open block's type
        self._called = False
        self._stop: tuple[str, str | None] = ("end_turn", None)
        self._parser: tools.AnswerParser | None = None
        if prepared.tools:
            self._parser = tools.NativeAnswerParser() if prepared.tools == "native" else tools.AnswerParser()
        text_head = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        self._text_head = text_head + b'"delta":{"type":"text_delta","text":'

    def opening(self) -> Sequence[bytes]:
        prepared = self._prepared
        start = message(self._id, prepared.model.id, [], (None, None), None)
        start["usage"]["input_tokens"] = len(prepared.job.prompt)  # the cache is known later
        events = [sse.named_event("message_start", {"type": "message_start", "message": start})]
        if self._parser is None:
            events.append(self._start({"type": "text", "text": ""}))
        return events

    def feed(self, piece: Piece) -> Sequence[bytes]:
        if self._parser is None:
            return (self._text(piece.text),) if piece.text else ()
        events: list[bytes] = []
        for event in self._parser.feed(piece.text):
            if isinstance(event, tools.Content):
                if self._open != "text":
                    events.extend(self._stop_block())
                    events.append(self._start({"type": "text", "text": ""}))
                events.append(self._delta({"type": "text_delta", "text": event.text}))
            elif isinstance(event, tools.CallStart):
                events.extend(self._stop_block())
                self._called = True
                events.append(self._start({"type": "tool_use", "id": tool_use_id(), "name": event.name, "input": {}}))
            else:
                events.append(self._delta({"type": "input_json_delta", "partial_json": event.fragment}))
        return events

    def finish(self, piece: Piece) -> Sequence[bytes]:
        assert piece.finish_reason is not None
        self._stop = stop_reason(piece.finish_reason, piece.stop_sequence, called=self._called)
        return self._stop_block()

    def closing(self, usage: Usage | None) -> Sequence[bytes]:
        delta = {"stop_reason": self._stop[0], "stop_sequence": self._stop[1]}
        counts: dict[str, Any] = usage_object(usage) if usage is not None else {"output_tokens": 0}
        return (
            sse.named_event("message_delta", {"type": "message_delta", "delta": delta, "usage": counts}),
            sse.named_event("message_stop", {"type": "message_stop"}),
        )

    def failed(self, error: ApiError) -> Sequence[bytes]:
        return (sse.named_event("error", error_body(error)),)

    def direct_text(self) -> Callable[[str], bytes] | None:
        return self._text if self._parser is None else None

    def direct_written(self) -> None:
        pass  # the events are not numbered

    def _start(self, block: dict[str, Any]) -> bytes:
        self._open = block["type"]
        self._blocks += 1
        payload = {"type": "content_block_start", "index": self._blocks - 1, "content_block": block}
        return sse.named_event("content_block_start", payload)

    def _delta(self, delta: dict[str, Any]) -> bytes:
        payload = {"type": "content_block_delta", "index": self._blocks - 1, "delta": delta}
        return sse.named_event("content_block_delta", payload)

    def _stop_block(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [sse.named_event("content_block_stop", {"type": "content_block_stop", "index": self._blocks - 1})]

    def _text(self, text: str) -> bytes:
        """A text delta of block 0 (a plain answer's only block), from bytes made once."""
        return self._text_head + sse.compact(text).encode() + b"}}\n\n"
