"""Server-Sent Events framing for OpenAI-style streams. Pure functions, no IO.

A stream is ``data: <json>`` events, each ended by a blank line, closed by ``data: [DONE]``.
Chunks of one stream differ only in their delta, so ``ChunkFramer`` renders the constant part
of the JSON once and encodes only the new text per token.
"""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def event(payload: Any) -> bytes:
    """One ``data:`` event carrying ``payload`` as compact JSON."""
    return b"data: " + _dumps(payload).encode() + b"\n\n"


def named_event(name: str, payload: Any) -> bytes:
    """One event with an ``event:`` line naming it (OpenAI's Responses and Anthropic's
    Messages streams name each event) and ``payload`` as compact JSON."""
    return b"event: " + name.encode() + b"\ndata: " + _dumps(payload).encode() + b"\n\n"


def compact(value: Any) -> str:
    """``value`` as the compact JSON text events carry."""
    return _dumps(value)


def error_event(message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
    return event({"error": {"message": message, "type": type_, "param": param, "code": code}})


class ChunkFramer:
    """Renders the chunks of one stream: chat (``chat.completion.chunk``, text in
    ``delta.content``) or completion (``text_completion``, text in ``text``)."""

    def __init__(
        self,
        *,
        chat: bool,
        id_: str,
        created: int,
        model: str,
        fingerprint: str | None = None,
        include_usage: bool = False,
    ) -> None:
        """``include_usage``: the stream ends with a usage chunk, and every chunk before it has
        ``"usage": null`` (OpenAI's ``stream_options.include_usage``)."""
        self.chat = chat
        head = {"id": id_, "object": "chat.completion.chunk" if chat else "text_completion", "created": created}
        head["model"] = model
        if fingerprint is not None:
            head["system_fingerprint"] = fingerprint
        self._head = _dumps(head)[:-1]  # without the closing brace
        self._end = (b',"usage":null}' if include_usage else b"}") + b"\n\n"  # after the choices
        self._choice_head = self._head.encode() + (
            b',"choices":[{"index":0,"delta":{"content":' if chat else b',"choices":[{"index":0,"text":'
        )
        self._choice_tail = (b"}" if chat else b"") + b',"logprobs":null,"finish_reason":null}]' + self._end

    def role(self, index: int = 0) -> bytes:
        """The first chat chunk of a choice: the assistant role, no content yet."""
        return self._choice({"index": index, "delta": {"role": "assistant", "content": ""}})

    def _choice(self, choice: dict[str, Any], logprobs: Any = None, finish_reason: str | None = None) -> bytes:
        """A chunk with one choice, through the general (slower) path."""
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        return b"data: " + self._head.encode() + b',"choices":[' + _dumps(choice).encode() + b"]" + self._end

    def text(self, text: str, logprobs: dict[str, Any] | None = None, index: int = 0) -> bytes:
        """A chunk of new text (and, when given, its tokens' log-probabilities) of choice
        ``index``. The usual case, choice 0 without logprobs, is rendered from bytes made once."""
        if logprobs is None and index == 0:
            return b"data: " + self._choice_head + _dumps(text).encode() + self._choice_tail
        choice = {"index": index, "delta": {"content": text}} if self.chat else {"index": index, "text": text}
        return self._choice(choice, logprobs)

    def delta(self, delta: dict[str, Any]) -> bytes:
        """A chat chunk with any ``delta`` (tool-call deltas, for one)."""
        return (
            b"data: "
            + self._head.encode()
            + b',"choices":[{"index":0,"delta":'
            + _dumps(delta).encode()
            + b',"logprobs":null,"finish_reason":null}]'
            + self._end
        )

    def finish(self, reason: str, index: int = 0) -> bytes:
        choice = {"index": index, "delta": {}} if self.chat else {"index": index, "text": ""}
        return self._choice(choice, finish_reason=reason)

    def usage(self, usage: dict[str, Any]) -> bytes:
        return f'data: {self._head},"choices":[],"usage":{_dumps(usage)}}}\n\n'.encode()
