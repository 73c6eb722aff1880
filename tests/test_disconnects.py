"""Clients that end their input, over raw sockets against a real server: one that closes the
connection (FIN, as an HTTP client does on a timeout) stops its work, streamed or not, for
chat, completions and embeddings; one that only closes its sending side (a half-close, as
``nc -N`` does) gets its answer; and a drain bounds the embeddings in progress."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support import sse
from tests.support.process import NO_END_TOKENS, ServerProcess, serving
from tests.support.rawhttp import dechunk, final_response, parse_head, request_bytes
from tests.support.waiting import wait_for

pytestmark = pytest.mark.server

CHAT = [{"role": "user", "content": "Count from one to a thousand."}]
ENDPOINTS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
# One input fills a decode (at most --batch-size 256 tokens): 256 of them are 256 decodes,
# seconds to minutes of work.
LONG_INPUT = "word " * 240
BIG_EMBEDDING = {"input": [LONG_INPUT] * 256}
GENERATED = "llama_trio_tokens_total{kind=generated}"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    args = ["--embeddings", "--parallel", "2", "--ctx-size", "4096", "--batch-size", "256", "--threads", "2"]
    with serving(args) as proc:
        yield proc


def generation(kind: str, *, stream: bool, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": CHAT} if kind == "chat" else {"prompt": "One, two, three,"}
    return {**body, "max_tokens": max_tokens, "temperature": 0, "logit_bias": NO_END_TOKENS, "stream": stream}


def send(server: ServerProcess, path: str, body: dict[str, Any]) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=120)
    sock.sendall(request_bytes("POST", path, body))
    return sock


def close_with_fin(sock: socket.socket) -> None:
    """Close as a client that gives up does: after reading what has come (a stream's chunks),
    so that the close is a FIN rather than a reset (unread data would make it a reset)."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        pass
    sock.close()


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


# -- a client that closes stops its work ----------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_client_that_closes_frees_its_sequence(server: ServerProcess, kind: str, stream: bool) -> None:
    max_tokens = 1500
    before = server.metrics()
    sock = send(server, ENDPOINTS[kind], generation(kind, stream=stream, max_tokens=max_tokens))
    wait_for(lambda: server.metrics()["llama_trio_active_sequences"] == 1, "the job to run", 60)
    close_with_fin(sock)
    # Before: a whole answer ran to max_tokens after its client had gone.
    wait_for(lambda: server.metrics()["llama_trio_active_sequences"] == 0, "the sequence to be freed", 60)
    after = server.metrics()
    assert after[GENERATED] - before[GENERATED] < max_tokens
    assert sum(after[k] - before[k] for k in after if k.startswith("llama_trio_cancellations_total")) == 1
    m = server.metrics()
    assert m["llama_trio_kv_cells_used"] == m["llama_trio_kv_cells_cached"]


def test_a_client_that_closes_during_a_long_prompt_chunk_stops_it_part_way() -> None:
    """A 1700-token prompt decoded in one step on one thread (seconds on any CPU): the client
    leaves during it, and that step stops part-way rather than run to its end."""
    args = ["--parallel", "1", "--ctx-size", "4096", "--batch-size", "2048", "--threads", "1"]
    with serving(args) as proc:
        body = {"prompt": "word " * 1700, "max_tokens": 4, "stream": True}
        sock = send(proc, "/v1/completions", body)
        # Active from its admission: its one step is under way.
        wait_for(lambda: proc.metrics()["llama_trio_active_sequences"] == 1, "the prompt to be decoding", 60)
        time.sleep(0.1)
        close_with_fin(sock)
        wait_for(lambda: proc.metrics()["llama_trio_active_sequences"] == 0, "the sequence to be freed", 60)
        m = proc.metrics()
        assert m["llama_trio_interrupted_steps_total"] == 1
        assert m["llama_trio_cancellations_total{phase=prefill}"] == 1
        assert m["llama_trio_tokens_total{kind=prompt}"] == 0  # the prompt never completed
        assert m["llama_trio_kv_cells_used"] == m["llama_trio_kv_cells_cached"] == 0
        # The server answers on.
        response = httpx.post(proc.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert response.status_code == 200


def test_a_client_that_closes_stops_its_embeddings(server: ServerProcess) -> None:
    before = server.metrics()
    sock = send(server, "/v1/embeddings", BIG_EMBEDDING)
    wait_for(
        lambda: server.metrics()["llama_trio_embedded_inputs_total"] > before["llama_trio_embedded_inputs_total"],
        "the embeddings to begin",
        120,
    )
    close_with_fin(sock)
    started = time.monotonic()
    # The embedder is free within its decode in progress: a tiny request is answered while the
    # big one would still have hundreds of decodes to go (before: it waited for all of them).
    response = httpx.post(server.url + "/v1/embeddings", json={"input": "hi"}, timeout=300)
    assert response.status_code == 200
    assert time.monotonic() - started < 30
    after = server.metrics()
    assert after["llama_trio_embedding_requests"] == 0
    assert after["llama_trio_embedded_inputs_total"] - before["llama_trio_embedded_inputs_total"] < 256
    assert after["llama_trio_embeddings_ended_early_total"] == before["llama_trio_embeddings_ended_early_total"] + 1


def test_a_client_that_closes_while_its_embeddings_wait_their_turn(server: ServerProcess) -> None:
    before = server.metrics()
    first = send(server, "/v1/embeddings", BIG_EMBEDDING)
    wait_for(lambda: server.metrics()["llama_trio_embedding_requests"] == 1, "the first to run", 60)
    second = send(server, "/v1/embeddings", BIG_EMBEDDING)
    wait_for(lambda: server.metrics()["llama_trio_embedding_requests"] == 2, "the second to wait", 60)
    close_with_fin(second)
    wait_for(lambda: server.metrics()["llama_trio_embedding_requests"] == 1, "the waiting one to leave", 30)
    close_with_fin(first)
    wait_for(lambda: server.metrics()["llama_trio_embedding_requests"] == 0, "the running one to stop", 60)
    after = server.metrics()
    assert after["llama_trio_embedded_inputs_total"] - before["llama_trio_embedded_inputs_total"] < 256
    assert after["llama_trio_embeddings_ended_early_total"] == before["llama_trio_embeddings_ended_early_total"] + 2


# -- a client that half-closes gets its answer ------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "kind"),
    [
        ("/v1/chat/completions", generation("chat", stream=False, max_tokens=8), "chat"),
        ("/v1/chat/completions", generation("chat", stream=True, max_tokens=8), "chat"),
        ("/v1/completions", generation("completion", stream=False, max_tokens=8), "completion"),
        ("/v1/completions", generation("completion", stream=True, max_tokens=8), "completion"),
        ("/v1/embeddings", {"input": [LONG_INPUT] * 3}, "embedding"),
    ],
    ids=["chat-whole", "chat-streamed", "completion-whole", "completion-streamed", "embeddings"],
)
def test_a_half_closed_client_gets_its_answer(
    server: ServerProcess, path: str, body: dict[str, Any], kind: str
) -> None:
    sock = send(server, path, body)
    with sock:
        sock.shutdown(socket.SHUT_WR)  # as `nc -N` does
        raw = read_all(sock)
    assert raw.startswith(b"HTTP/1.1 100 Continue\r\n\r\n") or body.get("stream"), raw[:200]
    head, _, rest = final_response(raw).partition(b"\r\n\r\n")
    status, headers = parse_head(head)
    assert status == 200, raw[:300]
    if body.get("stream"):
        parsed = sse.parse(dechunk(rest), kind=kind)  # type: ignore[arg-type]
        assert len(parsed.chunks) > 1 and parsed.finish_reasons == ["length"]
        return
    assert len(rest) == int(headers["content-length"])
    answer = json.loads(rest)
    if kind == "embedding":
        assert [d["index"] for d in answer["data"]] == [0, 1, 2]
    else:
        assert answer["usage"]["completion_tokens"] == 8


# -- the drain bounds embeddings ------------------------------------------------------------------


def post_in_thread(url: str, body: dict[str, Any], out: list[httpx.Response | Exception]) -> threading.Thread:
    def run() -> None:
        try:
            out.append(httpx.post(url, json=body, timeout=300))
        except Exception as exc:  # the test reports what came instead of an answer
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_the_drain_ends_embeddings_with_503s() -> None:
    drain = 2.0
    args = ["--embeddings", "--parallel", "2", "--ctx-size", "1024", "--batch-size", "256", "--threads", "2"]
    with ServerProcess([*args, "--drain-timeout", str(drain)]) as proc:
        proc.wait_ready()
        url = proc.url + "/v1/embeddings"
        running: list[httpx.Response | Exception] = []
        waiting: list[httpx.Response | Exception] = []
        threads = [post_in_thread(url, BIG_EMBEDDING, running)]
        wait_for(lambda: proc.metrics()["llama_trio_embedded_inputs_total"] > 0, "the embeddings to begin", 120)
        threads.append(post_in_thread(url, {"input": "hi"}, waiting))
        wait_for(lambda: proc.metrics()["llama_trio_embedding_requests"] == 2, "the second to wait", 60)
        proc.send_signal()
        for thread in threads:
            thread.join(300)
        assert proc.wait(120) == 0
    log = proc.log
    # Both end with a 503 (before: the connections were cut, no answer): the waiting one at
    # once, the running one after its decode in progress, not after its 256 decodes.
    for out in (waiting, running):
        assert len(out) == 1 and isinstance(out[0], httpx.Response), out
        assert out[0].status_code == 503, log[-3000:]
        assert out[0].json()["error"]["code"] == "server_shutting_down"
        assert out[0].headers["retry-after"] == "1"
