"""The prompt cache beyond the sequences (``server/engine/prompt_cache.py``): the host-RAM store
on its own, then real servers with more conversations than sequences."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from server.engine.prompt_cache import MIN_SAVED_TOKENS, Entry, HostCache
from tests.support.process import ServerProcess

# -- HostCache, pure -------------------------------------------------------------------------------


def entry(tokens: list[int], size: int = 10, scope: str = "") -> Entry:
    return Entry(scope, tokens, bytearray(size))


LONG = list(range(MIN_SAVED_TOKENS))


def test_lookup_finds_the_longest_saved_prefix_in_scope() -> None:
    cache = HostCache(100)
    short, long = entry(LONG), entry([*LONG, 1000, 1001])
    other = entry([*LONG, 1000, 1001, 1002], scope="bob")
    for e in (entry([5, *LONG]), short, other):
        assert cache.put(e)
    # ``short`` is a prefix of ``long``: filing ``long`` drops it.
    assert cache.put(long) and len(cache) == 3
    assert cache.lookup("", [*LONG, 1000, 1001, 1002]) == (long, len(LONG) + 2)
    assert cache.lookup("bob", [*LONG, 1000, 1001, 1002]) == (other, len(LONG) + 3)
    assert cache.lookup("carol", LONG) == (None, 0)


def test_bytes_stay_under_the_limit_least_recently_used_out() -> None:
    cache = HostCache(25)
    a, b, c = entry([1, *LONG]), entry([2, *LONG]), entry([3, *LONG])
    assert cache.put(a) and cache.put(b)
    cache.touch(a)  # b is now the least recently used
    assert cache.put(c)
    assert cache.bytes == 20 <= cache.limit
    assert cache.evictions == 1
    assert cache.lookup("", [2, *LONG])[0] is None
    assert cache.lookup("", [1, *LONG])[0] is a
    assert not cache.put(entry([4, *LONG], size=26))  # alone over the limit: nothing changes
    assert cache.bytes == 20 and len(cache) == 2


def test_wants_only_long_new_tokens() -> None:
    cache = HostCache(100)
    assert not cache.wants("", LONG[:-1])  # too short to be worth a copy
    assert cache.wants("", LONG)
    cache.put(entry([*LONG, 7]))
    assert not cache.wants("", LONG)  # already held, as the prefix of a saved entry
    assert cache.wants("bob", LONG)  # ... but not in bob's scope
    assert not HostCache(0).wants("", LONG)


# -- real servers ----------------------------------------------------------------------------------

WORDS = "amber basalt cobalt dune ember fjord granite harbor indigo juniper kelp lagoon".split()


def document(i: int, n: int = 55) -> str:
    return " ".join(f"{WORDS[(i * 5 + j * 7) % len(WORDS)]}{(i * 13 + j) % 89}" for j in range(n))


def chat(url: str, messages: list[dict[str, str]], key: str | None = None, **extra: Any) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, **extra}
    response = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def run_conversations(url: str, n_conversations: int, turns: int) -> list[tuple[int, int, int, str]]:
    """Round-robin turns of conversations that each carry their own document; per turn: its
    prompt tokens, the prompt tokens of the conversation's previous turn, cached tokens, answer."""
    conversations = [[{"role": "system", "content": f"Document {i}: {document(i)}"}] for i in range(n_conversations)]
    previous = [0] * n_conversations
    out = []
    for turn in range(turns):
        for i, messages in enumerate(conversations):
            messages.append({"role": "user", "content": f"Turn {turn}: which word comes after word {turn + 2}?"})
            answer = chat(url, messages)
            text = answer["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": text})
            prompt = answer["usage"]["prompt_tokens"]
            out.append((prompt, previous[i], cached(answer), text))
            previous[i] = prompt
    return out


# Two threads: nothing here is timed, and these prefills were over a minute of the suite on one
# (each dot product is one thread's whatever the count, so answers do not change with it).
SMALL = ["--parallel", "2", "--ctx-size", "2048", "--threads", "2"]


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    with ServerProcess(SMALL) as on, ServerProcess([*SMALL, "--cache-ram", "0"]) as off:
        on.wait_ready()
        off.wait_ready()
        yield on, off
        assert on.stop() == 0 and off.stop() == 0
    for proc in (on, off):
        assert "Traceback" not in proc.log, proc.log[-5000:]


@pytest.mark.server
def test_more_conversations_than_sequences_reuse_their_history(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    on, off = servers
    with_cache = run_conversations(on.url, 4, 2)
    without = run_conversations(off.url, 4, 2)
    # Greedy answers do not depend on where the cells came from.
    assert [t[3] for t in with_cache] == [t[3] for t in without]
    for prompt, previous, cached_tokens, _ in with_cache[4:]:
        # A later turn's history (its previous prompt, up to the end-of-turn markup) is cached.
        assert previous - 8 <= cached_tokens < prompt, with_cache
    # Without the host cache, two sequences cannot hold four documents.
    assert all(t[2] < MIN_SAVED_TOKENS for t in without[4:]), without
    metrics = on.metrics()
    assert metrics["llama_trio_prompt_cache_lookups_total{result=hit}"] >= 4
    assert metrics["llama_trio_prompt_cache_tokens_restored_total"] >= sum(t[1] - 8 for t in with_cache[4:])
    assert 0 < metrics["llama_trio_prompt_cache_bytes"]
    assert "restored=" in on.log


@pytest.mark.server
def test_the_ram_bound_holds() -> None:
    # About 23 KiB of state per token for this model: 10 MiB holds two of these conversations
    # (about 200 tokens each), not five.
    with ServerProcess([*SMALL, "--cache-ram", "10"]) as proc:
        proc.wait_ready()
        limit = 10 * 1024 * 1024
        conversations = [[{"role": "system", "content": f"Document {i}: {document(i)}"}] for i in range(5)]
        held = []
        for turn in range(2):
            for messages in conversations:
                messages.append({"role": "user", "content": f"Turn {turn}: summarise."})
                answer = chat(proc.url, messages)
                messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
                metrics = proc.metrics()
                held.append(metrics["llama_trio_prompt_cache_bytes"])
                assert held[-1] <= limit
        metrics = proc.metrics()
        assert metrics["llama_trio_prompt_cache_entries"] >= 1
        assert metrics["llama_trio_prompt_cache_evictions_total"] >= 1  # dropped to stay under the bound
        assert max(held) > limit / 2
        assert proc.stop() == 0
    assert "Traceback" not in proc.log


@pytest.mark.server
def test_saved_prefixes_stay_in_their_scope() -> None:
    args = ["--parallel", "1", "--ctx-size", "1024", "--threads", "1", "--api-key", "alice", "--api-key", "bob"]
    secret = [{"role": "system", "content": f"Alice's notes: {document(7)}"}, {"role": "user", "content": "Hi"}]
    other = [{"role": "system", "content": f"Other notes: {document(8)}"}, {"role": "user", "content": "Hi"}]
    alice = {"Authorization": "Bearer alice"}
    with ServerProcess(args) as proc:
        proc.wait_ready()
        chat(proc.url, secret, "alice")
        chat(proc.url, other, "alice")  # the only sequence moves on: alice's notes go to RAM
        assert proc.metrics(alice)["llama_trio_prompt_cache_entries"] == 1
        # Bob sends alice's exact prompt: nothing of hers is restored for him.
        assert cached(chat(proc.url, secret, "bob")) == 0
        assert cached(chat(proc.url, secret, "alice", cache_salt="s")) == 0  # a salt is its own scope
        # Control: alice herself gets her notes back from RAM.
        chat(proc.url, other, "alice")
        restored = proc.metrics(alice)["llama_trio_prompt_cache_tokens_restored_total"]
        assert cached(chat(proc.url, secret, "alice")) > MIN_SAVED_TOKENS
        assert proc.metrics(alice)["llama_trio_prompt_cache_tokens_restored_total"] > restored
        # A saved prefix serves any prompt that shares part of it: a new question on the same
        # notes gets the notes restored, and only the question computed.
        chat(proc.url, other, "alice")
        question = [secret[0], {"role": "user", "content": "Which word is the fourth?"}]
        answer = chat(proc.url, question, "alice")
        assert len(secret[0]["content"]) // 8 < cached(answer) < answer["usage"]["prompt_tokens"]
        assert proc.stop() == 0


def raw_stream_request(port: int, messages: list[dict[str, str]]) -> socket.socket:
    body = httpx.Request(
        "POST", "http://x/v1/chat/completions", json={"messages": messages, "max_tokens": 50, "stream": True}
    ).content
    sock = socket.create_connection(("127.0.0.1", port))
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    return sock


@pytest.mark.server
def test_clients_that_leave_during_a_restore_leak_nothing() -> None:
    with ServerProcess(["--parallel", "1", "--ctx-size", "1024", "--threads", "1"]) as proc:
        proc.wait_ready()
        first = [{"role": "system", "content": f"Notes: {document(3)}"}, {"role": "user", "content": "Hi"}]
        second = [{"role": "system", "content": f"Notes: {document(4)}"}, {"role": "user", "content": "Hi"}]
        chat(proc.url, first)
        for delay in (0.0, 0.001, 0.003, 0.01, 0.03, 0.1):
            chat(proc.url, second)  # ``first`` is now only in RAM
            sock = raw_stream_request(proc.port, first)  # restores it ...
            time.sleep(delay)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.close()  # ... and goes away (a reset) somewhere in between
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            metrics = proc.metrics()
            if metrics["llama_trio_active_sequences"] == 0 and metrics["llama_trio_queue_depth"] == 0:
                break
            time.sleep(0.05)
        assert metrics["llama_trio_active_sequences"] == 0
        assert metrics["llama_trio_kv_cells_used"] == metrics["llama_trio_kv_cells_cached"]
        assert sum(v for k, v in metrics.items() if k.startswith("llama_trio_cancellations_total")) >= 1
        assert metrics["llama_trio_prompt_cache_lookups_total{result=hit}"] >= 1
        # The engine goes on: the next turn restores and answers.
        chat(proc.url, second)
        assert cached(chat(proc.url, first)) > MIN_SAVED_TOKENS
        assert proc.stop() == 0
    assert "Traceback" not in proc.log
