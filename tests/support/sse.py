"""Reading OpenAI-style Server-Sent Events streams in tests, checking their framing.

A stream is events separated by blank lines: ``data: <json>`` events (chunks, or one error
event right before the end), ``: comment`` events (pings), and last ``data: [DONE]``. Every event
is one line. A chunk is ``chat.completion.chunk`` (text in ``delta.content``) or
``text_completion`` (text in ``text``); a usage chunk has ``"choices": []``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

DONE = b"data: [DONE]"
PING_COMMENT = b": ping\n\n"
ERROR_KEYS = frozenset({"message", "type", "param", "code"})
CHUNK_OBJECTS = {"chat": "chat.completion.chunk", "completion": "text_completion"}


@dataclass(frozen=True)
class Stream:
    """A parsed SSE body.

    ``events``: every event in order, comments and the final ``data: [DONE]`` included, each
    without its blank line. ``chunks``: the JSON objects of the ``data:`` events but ``[DONE]``
    and the error event, in order. ``error``: the ``error`` object of the error event, or None.
    """

    events: list[bytes]
    chunks: list[dict[str, Any]]
    error: dict[str, Any] | None

    @property
    def text(self) -> str:
        """The text of all chunks, concatenated."""
        return "".join(chunk_text(chunk) for chunk in self.chunks)

    @property
    def finish_reasons(self) -> list[str]:
        """The finish reasons of the chunks that have one, in order."""
        return finish_reasons(self.chunks)


def split_events(raw: bytes, *, comments: bool = True) -> list[bytes]:
    """The events of a complete SSE body, each without its blank line.

    Checks the framing: the body ends with ``data: [DONE]`` and a blank line, ``[DONE]`` comes
    only there, and every event is a single line that is a ``data: `` event or, when
    ``comments``, a ``: comment`` (with ``comments=False`` a comment fails the check).
    """
    assert raw.endswith(b"\n\n"), raw[-300:]
    events = raw[:-2].split(b"\n\n")
    assert events[-1] == DONE, raw[-300:]
    prefixes = (b"data: ", b": ") if comments else (b"data: ",)
    for event in events:
        assert event.startswith(prefixes), event
        assert b"\n" not in event, event
    assert DONE not in events[:-1], "data: [DONE] before the end"
    return events


def event_json(event: bytes) -> dict[str, Any] | None:
    """The JSON object of a ``data:`` event (without its blank line); None for a comment and
    for ``data: [DONE]``. Fails when the data is not a JSON object."""
    if not event.startswith(b"data: ") or event == DONE:
        return None
    return _object(event[6:])


def parse(
    raw: bytes,
    *,
    comments: bool = True,
    errors: bool = False,
    kind: Literal["chat", "completion"] | None = None,
) -> Stream:
    """Parse a complete SSE body, checking it as ``split_events`` does, and more: every
    ``data:`` event but ``[DONE]`` is a JSON object; an error event is allowed only with
    ``errors``, then only as the last event before ``[DONE]`` and with exactly the keys
    message, type, param and code; with ``kind`` every chunk has that kind's ``object``.
    """
    events = split_events(raw, comments=comments)
    chunks: list[dict[str, Any]] = []
    error = None
    for i, event in enumerate(events):
        payload = event_json(event)
        if payload is None:
            continue
        if "error" in payload:
            assert errors, f"an error event: {payload}"
            assert i == len(events) - 2, "an error event must come right before [DONE]"
            assert set(payload["error"]) == ERROR_KEYS, payload
            error = payload["error"]
            continue
        if kind is not None:
            assert payload["object"] == CHUNK_OBJECTS[kind], payload
        chunks.append(payload)
    return Stream(events, chunks, error)


def data_of(line: str) -> str | None:
    """The data of one line of a stream read line by line: what follows ``data: ``, without a
    trailing newline; None for any other line."""
    return line[6:].rstrip("\n") if line.startswith("data: ") else None


Payload = Mapping[str, Any] | str | bytes


def _object(data: str | bytes) -> dict[str, Any]:
    payload = json.loads(data)
    assert isinstance(payload, dict), data
    return payload


def _load(payload: Payload) -> Mapping[str, Any] | None:
    """A payload as a mapping: JSON text is parsed; None for ``[DONE]``."""
    if isinstance(payload, Mapping):
        return payload
    if payload in ("[DONE]", b"[DONE]"):
        return None
    return _object(payload)


def _choice(chunk: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The first choice of a chunk; None for ``[DONE]`` (None), an error event and a usage
    chunk. Fails (KeyError) for any other JSON without ``choices``."""
    if chunk is None or ("error" in chunk and "choices" not in chunk):
        return None
    choices = chunk["choices"]
    return choices[0] if choices else None


def chunk_text(payload: Payload) -> str:
    """The text one chunk carries: ``delta.content`` of a chat chunk (no content: ""),
    ``text`` of a completion chunk; "" for ``[DONE]``, an error event and a usage chunk.

    ``payload`` is the chunk, or the data of its event as JSON text.
    """
    chunk = _load(payload)
    choice = _choice(chunk)
    if chunk is None or choice is None:
        return ""
    if chunk["object"] == CHUNK_OBJECTS["chat"]:
        return str(choice["delta"].get("content") or "")
    assert chunk["object"] == CHUNK_OBJECTS["completion"], chunk
    return str(choice["text"])


def finish_reason(payload: Payload) -> str | None:
    """The finish reason of one chunk (the chunk, or its data as JSON text); None when it has
    none, and for ``[DONE]``, an error event and a usage chunk."""
    choice = _choice(_load(payload))
    reason = None if choice is None else choice["finish_reason"]
    return None if reason is None else str(reason)


def finish_reasons(chunks: Sequence[Payload]) -> list[str]:
    """The finish reasons of the chunks that have one (non-empty), in order."""
    return [reason for chunk in chunks if (reason := finish_reason(chunk))]


# -- named events (OpenAI's Responses and Anthropic's Messages streams) --------------------------


def named_events(raw: bytes, *, pings: bytes | None = PING_COMMENT) -> list[tuple[str, dict[str, Any]]]:
    """The events of a complete stream of named events, as (name, data): each event is an
    ``event: NAME`` line and a ``data: {json}`` line whose ``type`` is NAME, then a blank line.
    Checks that framing; ``pings`` is what a keep-alive event is (left out of the result), or
    None when none may come."""
    assert raw.endswith(b"\n\n"), raw[-300:]
    out = []
    for event in raw[:-2].split(b"\n\n"):
        if pings is not None and event + b"\n\n" == pings:
            continue
        lines = event.split(b"\n")
        assert len(lines) == 2 and lines[0].startswith(b"event: ") and lines[1].startswith(b"data: "), event
        name = lines[0][7:].decode()
        payload = _object(lines[1][6:])
        assert payload["type"] == name, event
        out.append((name, payload))
    return out
