"""OpenAI's Responses API stream as a ``StreamDialect``: named events, each with a
``sequence_number`` one above the last. ``response.created`` and ``response.in_progress``
first; then each output item as ``response.output_item.added``, its content
(``response.content_part.added``, ``response.output_text.delta``... ``.done``,
``response.content_part.done`` for a message; ``response.function_call_arguments.delta``...
``.done`` for a call) and ``response.output_item.done``; last ``response.completed``,
``response.incomplete`` (cut at ``max_output_tokens``) or ``response.failed`` (an error, the
drain's cut), with the whole response.

A plain answer's message is opened before the job runs, so every text delta after it differs
only in its text and its number: those take the direct path (``direct_text``), the number
counted when the engine task wrote it (``direct_written``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from server.api import sse, tools
from server.api.errors import ApiError
from server.api.prepare import Prepared
from server.api.responses_parse import new_id
from server.api.responses_render import call_item, message_item, response, status_of, text_part
from server.engine import Piece, Usage

TEXT_DELTA = "response.output_text.delta"


class _Item:
    """An output item being written: a message (``call_id`` None) or a call."""

    def __init__(self, index: int, id_: str, call_id: str | None = None, name: str = "") -> None:
        self.index = index
        self.id = id_
        self.call_id = call_id
        self.name = name
        self.parts: list[str] = []  # text, or the arguments' JSON text
        self.status = "in_progress"

    def render(self) -> dict[str, Any]:
        text = "".join(self.parts)
        if self.call_id is None:
            return message_item(self.id, self.status, text)
        return call_item(self.id, self.call_id, self.name, text, self.status)


class ResponsesStream:
    """The events of one Responses stream for ``prepared``; ``head`` is the response
    object's fields from its request (``responses_render.head``). Once the stream has ended
    well, ``final`` is the whole response."""

    ping = sse.PING

    def __init__(self, prepared: Prepared, head: dict[str, Any]) -> None:
        self._head = head
        self._seq = 0
        self._items: list[_Item] = []
        self._open: _Item | None = None
        self._finish = "stop"
        self.final: dict[str, Any] | None = None
        self._parser: tools.AnswerParser | None = None
        if prepared.tools:
            self._parser = tools.NativeAnswerParser() if prepared.tools == "native" else tools.AnswerParser()
        self._framed = ""  # the text of the piece ``_frame_text`` framed last
        self._delta_head = self._delta_where = b""  # a plain answer's text deltas, around the text

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse.named_event(kind, payload)

    def opening(self) -> Sequence[bytes]:
        in_progress = response(self._head, "in_progress", [], None)
        events = [self._event("response.created", response=in_progress)]
        events.append(self._event("response.in_progress", response=in_progress))
        if self._parser is None:
            events.extend(self._open_message())
            self._set_direct_frame()
        return events

    def feed(self, piece: Piece) -> Sequence[bytes]:
        if self._parser is None:
            return (self._text_delta(piece.text),) if piece.text else ()
        events: list[bytes] = []
        for event in self._parser.feed(piece.text):
            if isinstance(event, tools.Content):
                if self._open is None or self._open.call_id is not None:
                    events.extend(self._close("completed"))
                    events.extend(self._open_message())
                events.append(self._text_delta(event.text))
            elif isinstance(event, tools.CallStart):
                events.extend(self._close("completed"))
                events.extend(self._open_call(event.name))
            else:
                assert self._open is not None
                self._open.parts.append(event.fragment)
                fields = {"item_id": self._open.id, "output_index": self._open.index, "delta": event.fragment}
                events.append(self._event("response.function_call_arguments.delta", **fields))
        return events

    def finish(self, piece: Piece) -> Sequence[bytes]:
        assert piece.finish_reason is not None
        self._finish = piece.finish_reason
        return self._close(status_of(piece.finish_reason))

    def closing(self, usage: Usage | None) -> Sequence[bytes]:
        status = status_of(self._finish)
        self.final = response(self._head, status, self._output(), usage)
        return self._final_event()

    def closing_unstored(self) -> Sequence[bytes]:
        """``closing``'s event again, in its place, for a response that was not stored after
        all (its ``store`` false)."""
        assert self.final is not None
        self._seq -= 1
        self.final = {**self.final, "store": False}
        return self._final_event()

    def _final_event(self) -> Sequence[bytes]:
        assert self.final is not None
        kind = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        return (self._event(kind, response=self.final),)

    def failed(self, error: ApiError) -> Sequence[bytes]:
        events = list(self._close("incomplete"))
        failure = {"code": error.code or error.type, "message": error.message}
        failed = response(self._head, "failed", self._output(), None, failure)
        events.append(self._event("response.failed", response=failed))
        return events

    def direct_text(self) -> Callable[[str], bytes] | None:
        return self._frame_text if self._parser is None else None

    def direct_written(self) -> None:
        assert self._open is not None
        self._open.parts.append(self._framed)
        self._seq += 1

    # -- items ------------------------------------------------------------------------------

    def _output(self) -> list[dict[str, Any]]:
        return [item.render() for item in self._items]

    def _open_message(self) -> list[bytes]:
        item = self._add(_Item(len(self._items), new_id("msg")))
        where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        return [
            self._event(
                "response.output_item.added", output_index=item.index, item=message_item(item.id, "in_progress", None)
            ),
            self._event("response.content_part.added", **where, part=text_part("")),
        ]

    def _open_call(self, name: str) -> list[bytes]:
        item = self._add(_Item(len(self._items), new_id("fc"), tools.call_id(), name))
        added = item.render()
        return [self._event("response.output_item.added", output_index=item.index, item=added)]

    def _add(self, item: _Item) -> _Item:
        self._items.append(item)
        self._open = item
        return item

    def _close(self, status: str) -> list[bytes]:
        """The events that end the open item (none when none is open)."""
        item, self._open = self._open, None
        if item is None:
            return []
        text = "".join(item.parts)
        item.status = status
        done = item.render()
        if item.call_id is None:
            where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
            events = [
                self._event("response.output_text.done", **where, text=text, logprobs=[]),
                self._event("response.content_part.done", **where, part=text_part(text)),
            ]
        else:
            fields = {"item_id": item.id, "output_index": item.index, "name": item.name, "arguments": text}
            events = [self._event("response.function_call_arguments.done", **fields)]
        events.append(self._event("response.output_item.done", output_index=item.index, item=done))
        return events

    def _text_delta(self, text: str) -> bytes:
        item = self._open
        assert item is not None
        item.parts.append(text)
        if self._parser is not None:
            where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
            return self._event(TEXT_DELTA, **where, delta=text, logprobs=[])
        data = self._frame_text(text)  # the same bytes as the direct path's
        self._seq += 1
        return data

    def _set_direct_frame(self) -> None:
        """Render the constant parts of the open message's text deltas once."""
        assert self._open is not None
        head = f"event: {TEXT_DELTA}\ndata: " + '{"type":"' + TEXT_DELTA + '","sequence_number":'
        where = {"item_id": self._open.id, "output_index": self._open.index, "content_index": 0}
        self._delta_head = head.encode()
        self._delta_where = ("," + sse.compact(where)[1:-1] + ',"delta":').encode()
        self._delta_tail = b',"logprobs":[]}\n\n'

    def _frame_text(self, text: str) -> bytes:
        """A text delta of the open message, numbered ``_seq`` (not counted here)."""
        self._framed = text
        return (
            self._delta_head
            + str(self._seq).encode()
            + self._delta_where
            + sse.compact(text).encode()
            + self._delta_tail
        )
