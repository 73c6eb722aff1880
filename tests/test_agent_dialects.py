"""The Responses and Anthropic dialects without a model: parsing into the internal request, the
streams' events (the direct path's bytes equal to ``feed``'s, numbering, tool calls, the
terminal events), and errors renamed into a dialect's terms."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any

import pytest

from server.api import anthropic_parse, responses_parse, sse
from server.api.anthropic_stream import AnthropicStream
from server.api.errors import ApiError
from server.api.responses_stream import ResponsesStream
from server.engine import Piece, ShuttingDown, Usage
from tests.support.sse import named_events

USAGE = Usage(prompt_tokens=10, completion_tokens=3, cached_tokens=4)
CALL = '{"tool_calls": [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]}'


def prepared(tools: str | None = None) -> Any:
    """What the dialects read of a ``Prepared``."""
    return SimpleNamespace(tools=tools, model=SimpleNamespace(id="m"), job=SimpleNamespace(prompt=[1] * 10))


def responses_stream(tools: str | None = None) -> ResponsesStream:
    return ResponsesStream(prepared(tools), {"id": "resp_1", "object": "response", "model": "m"})


def run(dialect: Any, pieces: list[str], finish: str = "stop", direct: set[int] = frozenset()) -> bytes:  # type: ignore[assignment]
    """A stream's bytes, the pieces numbered in ``direct`` written through ``direct_text``."""
    out = list(dialect.opening())
    frame = dialect.direct_text()
    for i, text in enumerate(pieces):
        if i in direct:
            out.append(frame(text))
            dialect.direct_written()
        else:
            out.extend(dialect.feed(Piece(text, ())))
    last = Piece("", (), finish, USAGE)
    out.extend([*dialect.feed(last), *dialect.finish(last), *dialect.closing(USAGE)])
    return b"".join(out)


# -- Responses -------------------------------------------------------------------------------------


def same_ids(raw: bytes) -> bytes:
    return re.sub(rb"msg_[0-9a-f]{32}", b"msg_X", raw)  # each stream makes its own


def test_responses_direct_path_is_feed_byte_for_byte() -> None:
    pieces = ["Hel", "lo", ' "w"\n', "orld"]
    assert same_ids(run(responses_stream(), pieces)) == same_ids(run(responses_stream(), pieces, direct={1, 2}))
    dialect = responses_stream()
    dialect.opening()
    frame = dialect.direct_text()
    assert frame is not None
    framed = frame("x")  # not written: the same piece then goes through feed, numbered the same
    assert dialect.feed(Piece("x", ())) == (framed,)


def test_responses_text_stream_events() -> None:
    dialect = responses_stream()
    events = named_events(run(dialect, ["Hel", "lo"], direct={0}))
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    names = [name for name, _ in events]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[6][1]["text"] == "Hello"
    final = events[-1][1]["response"]
    assert final == dialect.final and final["status"] == "completed"
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["output"][0]["status"] == "completed"
    assert final["usage"]["input_tokens"] == 10 and final["usage"]["input_tokens_details"]["cached_tokens"] == 4


def test_responses_cut_short_is_incomplete() -> None:
    events = named_events(run(responses_stream(), ["a"], finish="length"))
    assert events[-1][0] == "response.incomplete"
    response = events[-1][1]["response"]
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"


def test_responses_tool_calls_stream_as_items() -> None:
    pieces = [CALL[i : i + 7] for i in range(0, len(CALL), 7)]
    events = named_events(run(responses_stream("generic"), pieces))
    names = [name for name, _ in events]
    added = [e for name, e in events if name == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"], e["item"]["name"]) for e in added] == [
        (0, "function_call", "f"),
        (1, "function_call", "g"),
    ]
    done = [e for name, e in events if name == "response.function_call_arguments.done"]
    assert [(e["output_index"], json.loads(e["arguments"])) for e in done] == [(0, {"x": 1}), (1, {})]
    for index in (0, 1):
        deltas = [
            e["delta"]
            for n, e in events
            if n == "response.function_call_arguments.delta" and e["output_index"] == index
        ]
        assert "".join(deltas) == done[index]["arguments"]
    assert names[-1] == "response.completed" and "response.content_part.added" not in names
    output = events[-1][1]["response"]["output"]
    assert [item["call_id"] for item in output] == [added[0]["item"]["call_id"], added[1]["item"]["call_id"]]


def test_responses_failed_ends_the_open_item() -> None:
    dialect = responses_stream()
    out = [*dialect.opening(), *dialect.feed(Piece("Hi", ()))]
    out.extend(dialect.failed(ApiError.from_engine(ShuttingDown("server is shutting down"))))
    events = named_events(b"".join(out))
    assert [name for name, _ in events][-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.failed",
    ]
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_shutting_down"
    assert failed["output"][0]["status"] == "incomplete" and dialect.final is None


def test_responses_input_items_and_internal_request() -> None:
    req = responses_parse.ResponsesRequest.model_validate(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_x",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "c", "annotations": []}],
                },
                {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "r1"},
                {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "r2"}]},
                {"role": "developer", "content": "d"},
            ],
            "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
            "tool_choice": {"type": "function", "name": "f"},
        }
    )
    items = responses_parse.input_items(req)
    assert [item["type"] for item in items] == [
        "message",
        "message",
        "function_call",
        "function_call",
        "function_call_output",
        "function_call_output",
        "message",
    ]
    assert items[1]["id"] == "msg_x" and items[0]["id"].startswith("msg_") and items[2]["id"].startswith("fc_")
    internal = responses_parse.internal_request(req, items)
    messages = [m.model_dump(exclude_none=True) for m in internal.messages]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "developer"]
    assert messages[1]["content"] == "a\nb" and messages[2]["content"] == "c"
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["call_1", "call_2"]  # one turn: text and calls
    assert messages[4] == {"role": "tool", "content": "r2", "tool_call_id": "call_2"}
    assert internal.response_format is not None and internal.response_format.type == "json_schema"
    assert internal.tool_choice is not None and internal.tool_choice.function.name == "f"  # type: ignore[union-attr]


def test_errors_renamed_into_a_dialects_terms() -> None:
    names = responses_parse.PARAM_NAMES
    cases = {
        "messages[3].content": "input",
        "tools[2].function.parameters": "tools[2].parameters",
        "response_format.json_schema.schema": "text.format.schema",
        "tool_choice.function.name": "tool_choice.name",
        "temperature": "temperature",
    }
    for internal, own in cases.items():
        error = ApiError(400, f"{internal}: bad", param=internal, code="invalid_value").renamed(names)
        assert (error.param, error.message, error.code) == (own, f"{own}: bad", "invalid_value")
    error = ApiError(400, "stop: too many", param="stop").renamed(anthropic_parse.PARAM_NAMES)
    assert (error.param, error.message) == ("stop_sequences", "stop_sequences: too many")


# -- Anthropic -------------------------------------------------------------------------------------


def test_anthropic_direct_path_is_feed_byte_for_byte() -> None:
    pieces = ["Hel", "lo", ' "w"\n', "orld"]
    assert run(AnthropicStream(prepared(), "msg_1"), pieces) == run(
        AnthropicStream(prepared(), "msg_1"), pieces, direct={0, 3}
    )


def test_anthropic_text_stream_events() -> None:
    events = named_events(run(AnthropicStream(prepared(), "msg_1"), ["Hel", "lo"]), pings=None)
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0][1]["message"]["usage"]["input_tokens"] == 10
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2][1]["usage"] == {
        "input_tokens": 6,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
        "output_tokens": 3,
    }


def test_anthropic_stop_reasons() -> None:
    dialect = AnthropicStream(prepared(), "msg_1")
    dialect.opening()
    dialect.finish(Piece("", (), "stop", USAGE, stop_sequence="END"))
    assert named_events(b"".join(dialect.closing(USAGE)), pings=None)[0][1]["delta"] == {
        "stop_reason": "stop_sequence",
        "stop_sequence": "END",
    }
    events = named_events(run(AnthropicStream(prepared(), "msg_1"), ["a"], finish="length"), pings=None)
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_anthropic_tool_use_blocks() -> None:
    pieces = [CALL[i : i + 5] for i in range(0, len(CALL), 5)]
    events = named_events(run(AnthropicStream(prepared("generic"), "msg_1"), pieces), pings=None)
    starts = [e for name, e in events if name == "content_block_start"]
    assert [(e["index"], e["content_block"]["type"], e["content_block"]["name"]) for e in starts] == [
        (0, "tool_use", "f"),
        (1, "tool_use", "g"),
    ]
    for index, expected in ((0, {"x": 1}), (1, {})):
        fragments = [
            e["delta"]["partial_json"] for n, e in events if n == "content_block_delta" and e["index"] == index
        ]
        assert json.loads("".join(fragments)) == expected
    assert [e["index"] for n, e in events if n == "content_block_stop"] == [0, 1]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_anthropic_error_event_and_ping() -> None:
    dialect = AnthropicStream(prepared(), "msg_1")
    [error] = dialect.failed(ApiError.from_engine(ShuttingDown("server is shutting down")))
    assert named_events(error, pings=None) == [
        ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "server is shutting down"}})
    ]
    assert named_events(dialect.ping, pings=None) == [("ping", {"type": "ping"})]


def test_anthropic_internal_request() -> None:
    req = anthropic_parse.MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 5,
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=2;"},
                {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
            ],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Paris"}, "caller": None},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18", "is_error": True},
                        {"type": "text", "text": "Thanks."},
                    ],
                },
            ],
            "tools": [{"name": "w", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"],
            "top_k": 3,
        }
    )
    internal = anthropic_parse.internal_request(req)
    messages = [m.model_dump(exclude_none=True) for m in internal.messages]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert messages[0]["content"] == "Be brief."  # the billing-header block left out
    assert messages[2]["content"] == "Let me look." and json.loads(
        messages[2]["tool_calls"][0]["function"]["arguments"]
    ) == {"city": "Paris"}
    assert messages[3] == {"role": "tool", "content": "Error: 18", "tool_call_id": "toolu_1"}
    assert internal.tool_choice == "required" and internal.parallel_tool_calls is False
    assert (internal.max_tokens, internal.stop, internal.top_k) == (5, ["END"], 3)


@pytest.mark.parametrize(
    "block",
    [
        {"type": "image", "source": {}},
        {"type": "document", "source": {}},
        {"type": "text", "text": "a", "citations": [{"x": 1}]},
    ],
)
def test_anthropic_content_it_cannot_take_is_refused(block: dict[str, Any]) -> None:
    req = anthropic_parse.CountTokensRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": [block]}]}
    )
    with pytest.raises(ApiError) as caught:
        anthropic_parse.internal_request(req)
    assert caught.value.status == 400 and caught.value.param is not None
    assert caught.value.param.startswith("messages[0].content[0]")


def test_named_event_framing() -> None:
    assert sse.named_event("ping", {"type": "ping"}) == b'event: ping\ndata: {"type":"ping"}\n\n'
