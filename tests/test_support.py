"""The shared test helpers themselves (tests/support): what they accept, and that they fail
on what the tests count on them to catch. Pure, no model, no server."""

from __future__ import annotations

import json
import socket
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support import sse
from tests.support.jsonprefix import close_json, parse_prefix
from tests.support.ports import free_port, plain_bind
from tests.support.process import ServerProcess
from tests.support.rawhttp import closed_by_peer, dechunk, parse_head, request_bytes
from tests.support.waiting import wait_for

CHUNK = {
    "object": "chat.completion.chunk",
    "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}],
}
FINISH = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
ERROR = {"error": {"message": "m", "type": "server_error", "param": None, "code": "server_shutting_down"}}


def data(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


# -- sse --------------------------------------------------------------------------------------


def test_parse_a_good_stream() -> None:
    raw = data(CHUNK) + b": ping\n\n" + data(FINISH) + DONE
    stream = sse.parse(raw, kind="chat")
    assert stream.events == [data(CHUNK)[:-2], b": ping", data(FINISH)[:-2], b"data: [DONE]"]
    assert stream.chunks == [CHUNK, FINISH]
    assert stream.text == "hi"
    assert stream.finish_reasons == ["stop"]
    assert stream.error is None


@pytest.mark.parametrize(
    "raw",
    [
        data(CHUNK),  # no [DONE]
        data(CHUNK) + b"data: [DONE]\n",  # no blank line at the end
        data(CHUNK) + b"data: [DONE]",
        b"data: " + b'{"a":\n1}' + b"\n\n" + DONE,  # an event of two lines
        data(CHUNK)[:-1] + DONE,  # events not separated by a blank line
        b"event: x\n\n" + DONE,  # neither data nor a comment
        b"data:{}\n\n" + DONE,  # no space after the colon
        DONE + data(CHUNK) + DONE,  # [DONE] before the end
        data(CHUNK) + b"\n" + DONE,  # an empty line too many
        b"data: data: [DONE]\n\n",
    ],
)
def test_split_events_fails_on_bad_framing(raw: bytes) -> None:
    with pytest.raises(AssertionError):
        sse.split_events(raw)


def test_comments_only_when_allowed() -> None:
    raw = b": ping\n\n" + data(CHUNK) + DONE
    assert sse.split_events(raw)[0] == b": ping"
    with pytest.raises(AssertionError):
        sse.split_events(raw, comments=False)


def test_error_event_only_when_allowed_and_last() -> None:
    raw = data(CHUNK) + data(ERROR) + DONE
    with pytest.raises(AssertionError):
        sse.parse(raw)
    stream = sse.parse(raw, errors=True)
    assert stream.error == ERROR["error"] and stream.chunks == [CHUNK]
    with pytest.raises(AssertionError):  # not right before [DONE]
        sse.parse(data(ERROR) + data(CHUNK) + DONE, errors=True)
    with pytest.raises(AssertionError):  # a comment after it counts too
        sse.parse(data(ERROR) + b": ping\n\n" + DONE, errors=True)
    with pytest.raises(AssertionError):  # a key missing
        sse.parse(data({"error": {"message": "m", "type": "t", "code": None}}) + DONE, errors=True)


def test_parse_fails_on_other_data() -> None:
    with pytest.raises(AssertionError):
        sse.parse(data(CHUNK) + DONE, kind="completion")
    with pytest.raises(AssertionError):
        sse.parse(data([1, 2]) + DONE)
    with pytest.raises(ValueError):
        sse.parse(b"data: {not json\n\n" + DONE)


def test_chunk_helpers() -> None:
    completion = {"object": "text_completion", "choices": [{"index": 0, "text": "yo", "finish_reason": "length"}]}
    usage = {"object": "text_completion", "choices": [], "usage": {}}
    assert sse.chunk_text(CHUNK) == "hi" and sse.chunk_text(json.dumps(CHUNK)) == "hi"
    assert sse.chunk_text(completion) == "yo" and sse.finish_reason(completion) == "length"
    for quiet in ("[DONE]", json.dumps(ERROR), usage, FINISH):
        assert sse.chunk_text(quiet) == ""
    for no_reason in ("[DONE]", json.dumps(ERROR), usage, CHUNK):
        assert sse.finish_reason(no_reason) is None
    assert sse.finish_reasons([CHUNK, FINISH, completion, usage]) == ["stop", "length"]
    with pytest.raises(KeyError):  # neither a chunk nor an error event
        sse.chunk_text({"object": "chat.completion.chunk"})
    assert sse.data_of("data: {}\n") == "{}" and sse.data_of(": ping") is None and sse.data_of("") is None
    assert sse.event_json(b": ping") is None and sse.event_json(b"data: [DONE]") is None
    assert sse.event_json(data(CHUNK)[:-2]) == CHUNK


# -- rawhttp ----------------------------------------------------------------------------------


def test_request_bytes() -> None:
    assert request_bytes("GET", "/health") == b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n"
    assert request_bytes("POST", "/v1/completions", {"prompt": "x"}) == (
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b'Content-Length: 15\r\n\r\n{"prompt": "x"}'
    )
    assert request_bytes("POST", "/p", b"{", content_length=9, host="h", headers={"X-A": "1"}) == (
        b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\nContent-Length: 9\r\nX-A: 1\r\n\r\n{"
    )
    assert request_bytes("POST", "/p", b"{}", host=None, version="HTTP/1.0") == (
        b"POST /p HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    )


def test_parse_head() -> None:
    assert parse_head(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nX-Y:  z ") == (
        503,
        {"retry-after": "1", "x-y": "z"},
    )
    with pytest.raises(AssertionError):
        parse_head(b"HTTP/1.1 200 OK\r\nno colon here")


def test_dechunk() -> None:
    assert dechunk(b"3\r\nabc\r\na\r\n0123456789\r\n0\r\n\r\n") == b"abc0123456789"
    assert dechunk(b"0\r\n\r\n") == b""
    for bad in (
        b"3\r\nabc\r\n",  # no last chunk
        b"3\r\nabcd\r\n0\r\n\r\n",  # longer than announced
        b"3\r\nabc\r\n0\r\n\r\nmore",  # bytes after the last chunk
        b"3\r\nabc",  # truncated
    ):
        with pytest.raises(AssertionError):
            dechunk(bad)


def test_closed_by_peer() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.sendall(b"leftover")
        assert not closed_by_peer(a)
        b.close()
        assert closed_by_peer(a)


# -- waiting and ports ------------------------------------------------------------------------


def test_wait_for() -> None:
    start = time.monotonic()
    assert wait_for(lambda: time.monotonic() - start > 0.05, "a moment", 5) >= 0.05
    with pytest.raises(AssertionError, match="waiting for the impossible"):
        wait_for(lambda: False, "the impossible", 0.05)


def test_free_port_and_plain_bind() -> None:
    port = free_port()
    assert plain_bind(port) is None
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        failure = plain_bind(port)
        assert failure is not None and failure.errno is not None


# -- jsonprefix -------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(json_values, st.sampled_from([(", ", ": "), (",", ":")]), st.booleans(), st.booleans())
def test_every_prefix_of_a_json_text_parses(
    value: object, separators: tuple[str, str], ascii: bool, indent: bool
) -> None:
    text = json.dumps(value, separators=separators, ensure_ascii=ascii, indent=2 if indent else None)
    assert parse_prefix(text) == value
    for end in range(len(text)):
        parse_prefix(text[:end])


@pytest.mark.parametrize(
    ("prefix", "closed"),
    [
        ("", "null"),
        ('{"a": "x\\', '{"a": "x\\n"}'),
        ('{"a": "\\u00', '{"a": "\\u0000"}'),
        ('{"a": 1.', '{"a": 1.0}'),
        ('{"a": [1, -', '{"a": [1, -0]}'),
        ("[tr", "[true]"),
        ('{"a": {"b', '{"a": {"b": 0}}'),
        ('{"a": 1, ', '{"a": 1, "": 0}'),
        ("[1e+", "[1e+0]"),
    ],
)
def test_close_json_closes_the_shortest_way(prefix: str, closed: str) -> None:
    assert close_json(prefix) == closed


@pytest.mark.parametrize("prefix", ['{"a" 1', '{"a": 1}}', "[1,,", "{1", "[tru e", '"\\x', '{"a": 01', "[1] [", "]"])
def test_what_begins_no_json_text_fails(prefix: str) -> None:
    with pytest.raises(AssertionError, match="not the beginning of a JSON text"):
        parse_prefix(prefix)


# -- needs ------------------------------------------------------------------------------------


def test_starting_a_server_without_the_marker_fails_before_it_starts() -> None:
    with pytest.raises(AssertionError, match=r"starts a server process but is not marked `server`"):
        ServerProcess(["--version"])
