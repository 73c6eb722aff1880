"""``ChunkFramer`` and the SSE constants: pure, no model. Every output is one well-formed
``data: <json>`` event whose JSON has the OpenAI chunk shape, and text round-trips exactly."""

from __future__ import annotations

import json
from typing import Any

import pytest

from server.api.sse import DONE, PING, ChunkFramer, error_event, event
from tests.support import sse

ID = "chatcmpl-abc123"
CREATED = 1_700_000_000
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
USAGE = {
    "prompt_tokens": 7,
    "completion_tokens": 3,
    "total_tokens": 10,
    "prompt_tokens_details": {"cached_tokens": 0},
}
# Text that JSON must escape, or that is not ASCII: each must come back exactly.
TEXTS = [
    "",
    "plain",
    'a "quoted" word',
    "back\\slash \\n not a newline",
    "line\nbreak\r\nand\ttab",
    "\x00\x01\x1f\x7f control",
    "naïve café, Straße, 日本語, Ελληνικά",
    "emoji 🦙👍🏽 and a flag 🇫🇷",
    "\u2028\u2029 line and paragraph separators",
    "</script><!-- -->",
    "data: [DONE]\n\n",
    "{}[],:",
]


def framer(chat: bool, model: str = MODEL) -> ChunkFramer:
    return ChunkFramer(chat=chat, id_=ID, created=CREATED, model=model)


def one_event(out: bytes) -> dict[str, Any]:
    """The JSON object of ``out``, checked to be exactly one ``data: <json>\\n\\n`` event."""
    assert isinstance(out, bytes)
    assert out.startswith(b"data: "), out
    assert out.endswith(b"\n\n"), out
    assert b"\n" not in out[:-2] and b"\r" not in out, out
    payload = json.loads(out[len(b"data: ") : -2].decode("utf-8"))
    assert isinstance(payload, dict), payload
    return payload


def head(chat: bool, model: str = MODEL) -> dict[str, Any]:
    """The fields every chunk of a stream shares."""
    return {
        "id": ID,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": CREATED,
        "model": model,
    }


def test_constants() -> None:
    assert DONE == b"data: [DONE]\n\n"
    assert PING == b": ping\n\n"


def test_chat_role_chunk() -> None:
    assert one_event(framer(chat=True).role()) == {
        **head(True),
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        ],
    }


@pytest.mark.parametrize("text", TEXTS)
def test_chat_text_chunk_round_trips(text: str) -> None:
    assert one_event(framer(chat=True).text(text)) == {
        **head(True),
        "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}],
    }


@pytest.mark.parametrize("text", TEXTS)
def test_completion_text_chunk_round_trips(text: str) -> None:
    assert one_event(framer(chat=False).text(text)) == {
        **head(False),
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}],
    }


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_finish_chunk(reason: str) -> None:
    assert one_event(framer(chat=True).finish(reason)) == {
        **head(True),
        "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}],
    }
    assert one_event(framer(chat=False).finish(reason)) == {
        **head(False),
        "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": reason}],
    }


@pytest.mark.parametrize("chat", [True, False])
def test_usage_chunk(chat: bool) -> None:
    assert one_event(framer(chat).usage(USAGE)) == {**head(chat), "choices": [], "usage": USAGE}


@pytest.mark.parametrize("chat", [True, False])
def test_head_fields_with_quotes_and_non_ascii_round_trip(chat: bool) -> None:
    model = 'a "model" \\ named ü 🦙'
    f = framer(chat, model=model)
    outputs = [f.text("x"), f.finish("stop"), f.usage(USAGE)] + ([f.role()] if chat else [])
    for out in outputs:
        payload = one_event(out)
        assert {k: payload[k] for k in ("id", "object", "created", "model")} == head(chat, model)


@pytest.mark.parametrize("chat", [True, False])
def test_a_whole_stream_parses_to_its_text(chat: bool) -> None:
    f = framer(chat)
    raw = b"".join(
        [*([f.role()] if chat else []), *(f.text(t) for t in TEXTS), PING, f.finish("length"), f.usage(USAGE), DONE]
    )
    stream = sse.parse(raw, kind="chat" if chat else "completion")
    assert stream.text == "".join(TEXTS)
    assert stream.finish_reasons == ["length"]
    assert stream.chunks[-1]["usage"] == USAGE
    assert stream.error is None
    assert b": ping" in stream.events


def test_error_event_shape() -> None:
    assert one_event(error_event("server is shutting down", "server_error", "server_shutting_down")) == {
        "error": {
            "message": "server is shutting down",
            "type": "server_error",
            "param": None,
            "code": "server_shutting_down",
        }
    }
    message = 'bad "value"\nü 🦙'
    assert one_event(error_event(message, "invalid_request_error", None, param="messages[0].content")) == {
        "error": {"message": message, "type": "invalid_request_error", "param": "messages[0].content", "code": None}
    }


@pytest.mark.parametrize("payload", [{"a": [1, 2.5, None, True]}, {"text": "line\nbreak 🦙"}, {}])
def test_event_is_one_data_event(payload: dict[str, Any]) -> None:
    assert one_event(event(payload)) == payload


@pytest.mark.parametrize("chat", [True, False])
def test_with_include_usage_every_chunk_before_the_last_has_a_null_usage(chat: bool) -> None:
    # OpenAI's stream_options.include_usage: "usage": null on each chunk, the totals on the last.
    f = ChunkFramer(chat=chat, id_=ID, created=CREATED, model=MODEL, include_usage=True)
    chunks = [f.text("a"), f.text("b", index=1), f.text("c", {"content": []}), f.finish("stop")]
    if chat:
        chunks += [f.role(), f.delta({"tool_calls": []})]
    assert all("usage" in one_event(c) and one_event(c)["usage"] is None for c in chunks)
    assert one_event(f.usage({"prompt_tokens": 1}))["usage"] == {"prompt_tokens": 1}
    assert all("usage" not in one_event(c) for c in (framer(chat).text("a"), framer(chat).finish("stop")))
