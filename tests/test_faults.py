"""Faults at the connection level, against one real server with tight limits: a client that stops
reading mid-stream, floods of idle connections, slow header senders (slowloris), oversized heads
and bodies, slow bodies. Each must be bounded by its timeout or limit while real clients keep
being served.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support import sse
from tests.support.process import NO_END_TOKENS, ServerProcess, serving
from tests.support.rawhttp import closed_by_peer, dechunk, read_head, request_bytes
from tests.support.waiting import wait_for

pytestmark = pytest.mark.server

KEEP_ALIVE = 2.0
WRITE_TIMEOUT = 4.0
READ_TIMEOUT = 2.0
MAX_CONNECTIONS = 16
MAX_HEADER = 4096
# Slack on every "within N seconds" below: the machine is shared and has two cores.
SLACK = 3.0


@pytest.fixture(scope="module")
def limited() -> Iterator[ServerProcess]:
    args = [
        *("--parallel", "4", "--ctx-size", "4096", "--threads", "1"),
        *("--keep-alive-timeout", str(KEEP_ALIVE), "--write-timeout", str(WRITE_TIMEOUT)),
        *("--read-timeout", str(READ_TIMEOUT), "--max-connections", str(MAX_CONNECTIONS)),
        *("--max-header-size", str(MAX_HEADER)),
    ]
    with serving(args) as proc:
        yield proc


def server_sockets(pid: int) -> int:
    """Open sockets of a process (its listener included)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


def stream_chat(url: str, max_tokens: int) -> list[dict[str, Any]]:
    """A streamed chat completion that runs to ``max_tokens`` (its end tokens banned), checked
    for framing and its usage; its JSON events."""
    body = {
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": NO_END_TOKENS,
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        raw = response.read()
    events = sse.parse(raw).chunks
    assert sse.finish_reasons(events) == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == max_tokens
    return events


def small_window_stream(port: int, max_tokens: int) -> socket.socket:
    """A raw socket that has asked for a long streamed chat (greedy, to max_tokens). Its small
    window and segment size make the server's writes block after some 200 chunks (on loopback
    the send buffer would otherwise grow to megabytes)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect(("127.0.0.1", port))
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "logit_bias": NO_END_TOKENS,
    }
    sock.sendall(request_bytes("POST", "/v1/chat/completions", body))
    return sock


def test_client_that_stops_reading_is_cut_and_stalls_no_one(limited: ServerProcess) -> None:
    m = limited.metrics()
    cancelled_before = m["llama_trio_cancellations_total{phase=generate}"]
    stalled = small_window_stream(limited.port, 900)
    try:
        # Writes block, the job's channel fills, the engine pauses that one sequence.
        wait_for(lambda: limited.metrics()["llama_trio_paused_sequences"] == 1, "the stalled sequence to pause", 120)
        paused_at = time.monotonic()
        # Another stream runs to its end meanwhile.
        stream_chat(limited.url, 12)
        # The stalled connection is cut after the write timeout; its sequence and cells are freed.
        wait_for(
            lambda: limited.metrics()["llama_trio_active_sequences"] == 0,
            "the stalled stream to be cut",
            WRITE_TIMEOUT + SLACK + 10,
        )
        cut_after = time.monotonic() - paused_at
        assert cut_after <= WRITE_TIMEOUT + SLACK + 10
        assert "closing a connection whose client stopped reading" in limited.log
        m = limited.metrics()
        assert m["llama_trio_cancellations_total{phase=generate}"] == cancelled_before + 1
        assert m["llama_trio_kv_cells_used"] == m["llama_trio_kv_cells_cached"]
        assert m["llama_trio_paused_sequences"] == 0
        stalled.settimeout(10)
        wait_for(lambda: closed_by_peer(stalled), "the stalled socket to be closed", 10)
    finally:
        stalled.close()


def test_slow_reader_gets_every_byte_of_a_stream_whose_writes_blocked(limited: ServerProcess) -> None:
    """The server's writes fill the socket (some go out in part, the rest waits for the
    reader); once the reader catches up, well within the write timeout, the whole stream
    arrives with intact chunked framing and SSE events."""
    max_tokens = 400
    slow = small_window_stream(limited.port, max_tokens)
    try:
        wait_for(lambda: limited.metrics()["llama_trio_paused_sequences"] == 1, "the server's writes to block", 120)
        time.sleep(WRITE_TIMEOUT / 4)
        slow.settimeout(60)
        raw = bytearray()
        while not raw.endswith(b"\r\n0\r\n\r\n"):
            data = slow.recv(65536)
            assert data, f"connection closed after {len(raw)} bytes"
            raw += data
    finally:
        slow.close()
    head, _, chunked = bytes(raw).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    events = sse.parse(dechunk(chunked), comments=False).chunks
    contents = [e for e in events if sse.chunk_text(e)]
    assert sse.finish_reasons(events) == ["length"]
    # A piece per token, but for ones held back by the detokenizer (parts of a character):
    # greedy English text has next to none, on any CPU.
    assert len(contents) >= max_tokens * 0.9
    assert limited.metrics()["llama_trio_active_sequences"] == 0


def test_idle_flood_and_slowloris_are_bounded(limited: ServerProcess) -> None:
    pid = limited.proc.pid
    baseline = server_sockets(pid)
    idle = [socket.create_connection(("127.0.0.1", limited.port)) for _ in range(4 * MAX_CONNECTIONS)]
    slow = [socket.create_connection(("127.0.0.1", limited.port)) for _ in range(8)]
    stop = threading.Event()

    def drip() -> None:  # one header line every 0.3 s; a head that never ends
        for s in slow:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")
        while not stop.is_set():
            for s in slow:
                try:
                    s.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    pass
            stop.wait(0.3)

    dripper = threading.Thread(target=drip)
    dripper.start()
    try:
        # Real clients are served at once, each on a fresh connection, while the flood sits.
        worst = 0.0
        for i in range(6):
            started = time.monotonic()
            with httpx.Client(base_url=limited.url, timeout=30) as client:
                if i % 2:
                    assert client.get("/health").status_code == 200
                else:
                    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
                    assert client.post("/v1/completions", json=body).status_code == 200
            worst = max(worst, time.monotonic() - started)
        assert worst < SLACK, f"a real client waited {worst:.1f} s behind the flood"
        # The server never holds more than max_connections connections.
        assert server_sockets(pid) <= baseline + MAX_CONNECTIONS
        # Every idle and slow connection is closed by the server within the keep-alive timeout
        # (counted from now; some were closed early to make room).
        deadline = time.monotonic() + KEEP_ALIVE + SLACK
        for s in idle + slow:
            wait_for(
                lambda s=s: closed_by_peer(s), "an idle or slow connection to be closed", deadline - time.monotonic()
            )
        wait_for(lambda: server_sockets(pid) <= baseline, "the server to let go of them", 5)
    finally:
        stop.set()
        dripper.join()
        for s in idle + slow:
            s.close()
    assert httpx.get(limited.url + "/health", timeout=5).status_code == 200


def test_a_flood_of_slow_bodies_locks_no_one_out() -> None:
    """Every connection taken by a request whose body arrives a byte at a time: a real client
    still gets in, long before --read-timeout would free one, because at the limit the request
    whose body has been arriving the longest is cut for it."""
    args = ["--parallel", "1", "--threads", "1", "--max-connections", "4", "--read-timeout", "120"]
    with ServerProcess(args) as proc:
        proc.wait_ready()
        slow = [socket.create_connection(("127.0.0.1", proc.port)) for _ in range(4)]
        for sock in slow:
            sock.sendall(request_bytes("POST", "/v1/completions", b"{", content_length=1000))
        time.sleep(1.5)  # every head is in (they are requests, not idle connections), and the bodies slow
        stop = threading.Event()

        def drip() -> None:
            while not stop.is_set():
                for sock in slow:
                    with contextlib.suppress(OSError):
                        sock.sendall(b" ")
                stop.wait(0.2)

        dripper = threading.Thread(target=drip)
        dripper.start()
        try:
            for _ in range(3):
                # The hang guard is far below --read-timeout: only a cut lets these in.
                assert httpx.get(proc.url + "/health", timeout=30).status_code == 200
            assert any(closed_by_peer(sock) for sock in slow)
        finally:
            stop.set()
            dripper.join()
            for sock in slow:
                sock.close()
        assert "cut a request whose body has been arriving" in proc.log
        assert proc.stop() == 0
        assert "Traceback" not in proc.log


def test_head_over_max_header_size_is_431(limited: ServerProcess) -> None:
    # In one piece (the app's check) and in pieces slower than one read (h11's bound).
    big = b"X-Big: " + b"a" * (2 * MAX_HEADER) + b"\r\n"
    response = httpx.get(limited.url + "/health", headers={"X-Big": "a" * (2 * MAX_HEADER)}, timeout=10)
    assert response.status_code == 431
    assert response.headers["connection"] == "close"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.json()["error"]["code"] == "request_header_too_large"
    response = httpx.get(limited.url + "/health?" + "q" * (2 * MAX_HEADER), timeout=10)  # the query counts
    assert response.status_code == 431
    with socket.create_connection(("127.0.0.1", limited.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n")
        for i in range(0, len(big), 1024):
            try:
                sock.sendall(big[i : i + 1024])
            except OSError:
                break
            time.sleep(0.02)
        sock.settimeout(10)
        status, headers, body = read_head(sock)  # h11's bound: the same answer as the app's
        while len(body) < int(headers["content-length"]):
            body += sock.recv(65536)
        assert status == 431 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "request_header_too_large"
        assert str(MAX_HEADER) in json.loads(body)["error"]["message"]
        wait_for(lambda: closed_by_peer(sock), "the connection to close", 5)
    assert httpx.get(limited.url + "/health", timeout=5).status_code == 200


def test_slow_body_is_408_after_read_timeout(limited: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", limited.port)) as sock:
        started = time.monotonic()
        sock.sendall(request_bytes("POST", "/v1/completions", b'{"prompt": ', content_length=100))
        sock.settimeout(READ_TIMEOUT + SLACK + 5)
        raw = b""
        while b"\r\n\r\n" not in raw or not raw.endswith(b"}}"):
            chunk = sock.recv(4096)
            assert chunk, raw
            raw += chunk
        took = time.monotonic() - started
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408")
        assert b"connection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert READ_TIMEOUT - 0.1 <= took <= READ_TIMEOUT + SLACK
        wait_for(lambda: closed_by_peer(sock), "the connection to close", 5)


def test_oversized_body_closes_the_connection_and_the_next_request_is_served(limited: ServerProcess) -> None:
    """Found by fuzzing: after a 413 answered before the body was read, the connection stayed
    open with the unread body on it, and the next request on that keep-alive connection hung."""
    big = json.dumps({"prompt": "ab " * 1_500_000}).encode()
    with httpx.Client(base_url=limited.url, timeout=10) as client:
        for _ in range(4):
            response = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
            assert response.status_code == 413
            assert response.headers["connection"] == "close"
            assert response.json()["error"]["code"] == "request_too_large"
            small = client.post("/v1/completions", json={"prompt": 5})
            assert small.status_code == 400
    # Over a raw socket, with only part of the body sent: answered, then closed.
    with socket.create_connection(("127.0.0.1", limited.port)) as sock:
        sock.sendall(request_bytes("POST", "/v1/completions", {"prompt": "x" * 5_000_000})[:100_000])
        sock.settimeout(10)
        assert sock.recv(100).startswith(b"HTTP/1.1 413")
        wait_for(lambda: closed_by_peer(sock), "the connection to close", 5)


PING_INTERVAL = 0.5


def test_pings_go_to_a_silent_stream_only() -> None:
    """A queued stream gets ``: ping`` comments while it waits; a stream that is generating
    (its text written straight to the socket by the engine) gets none once its text flows (its
    prompt step may take longer than the interval on a busy machine), and both are well formed."""
    args = ["--parallel", "1", "--ctx-size", "1024", "--threads", "1", "--ping-interval", str(PING_INTERVAL)]
    with ServerProcess(args) as server:
        server.wait_ready()
        raw: dict[str, bytes] = {}

        def run(name: str, max_tokens: int) -> None:
            body = {
                "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": max_tokens,
                "stream": True,
                "temperature": 0,
                "logit_bias": NO_END_TOKENS,
            }
            with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as response:
                assert response.status_code == 200
                raw[name] = response.read()

        running = threading.Thread(target=run, args=("running", 200))
        running.start()
        wait_for(lambda: server.metrics()["llama_trio_active_sequences"] == 1, "the first stream to start", 60)
        queued = threading.Thread(target=run, args=("queued", 4))
        queued.start()
        running.join(120)
        queued.join(120)
        assert server.stop() == 0
    assert "Traceback" not in server.log, server.log[-5000:]
    running_events = sse.split_events(raw["running"])
    first_text = next(i for i, e in enumerate(running_events) if _content(e))
    assert b": ping" not in running_events[first_text:]
    assert sum(1 for e in running_events if sse.event_json(e) is not None) >= 200
    queued_events = sse.split_events(raw["queued"])
    pings = queued_events.count(b": ping")
    assert pings >= 2, raw["queued"][:500]
    first_text = next(i for i, e in enumerate(queued_events) if _content(e))
    assert queued_events.index(b": ping") < first_text  # the pings came while it waited


def _content(event: bytes) -> str:
    """The text of a chunk event; "" for any other event (an error event fails)."""
    payload = sse.event_json(event)
    assert payload is None or "error" not in payload, payload
    return sse.chunk_text(payload) if payload is not None else ""


def test_http_1_0_stream_is_delimited_by_close(limited: ServerProcess) -> None:
    """An HTTP/1.0 client gets the stream unchunked, ended by the server's close (h11 frames it;
    the direct chunk writes stay out of it)."""
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 24, "temperature": 0, "logit_bias": NO_END_TOKENS}
    whole = httpx.post(limited.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    request = request_bytes("POST", "/v1/completions", {**body, "stream": True}, host=None, version="HTTP/1.0")
    with socket.create_connection(("127.0.0.1", limited.port), timeout=60) as sock:
        sock.sendall(request)
        raw = bytearray()
        while data := sock.recv(65536):
            raw += data
    head_bytes, _, stream = bytes(raw).partition(b"\r\n\r\n")
    assert head_bytes.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head_bytes.lower()
    parsed = sse.parse(stream, comments=False)
    assert parsed.text == whole  # every piece arrived: the same greedy answer as a whole one
    assert parsed.finish_reasons == ["length"]
