"""Soak: 32 concurrent clients against one real server for ``--soak-seconds`` (60 by default;
``LLAMA_TRIO_SOAK_SECONDS`` too), then SIGTERM in the middle of the same kind of load.

The mix: streamed and non-streamed chat and completions; about a third of the requests are
abandoned at a random moment (right after sending, after a random short wait, mid-stream, right
after the last token, or a non-streamed one mid-generation); a few send malformed bodies or a
cut-short body. Every request that is not abandoned must get a complete, well-formed answer.
Afterwards no sequence, queue entry or KV cell of an active sequence is left, there was no 5xx,
the server's RSS is within 5 % of its level after warm-up (plus the host prompt cache's bound)
and /health answers fast.
"""

from __future__ import annotations

import collections
import json
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.support import sse
from tests.support.process import NO_END_TOKENS, ServerProcess
from tests.support.rawhttp import request_bytes

pytestmark = [pytest.mark.slow, pytest.mark.server]

CLIENTS = 32
# Up to this many generated tokens per request (the server's --max-tokens ceiling too).
MAX_TOKENS = 16
# Share of the soak spent warming up before the RSS baseline is taken.
WARM_UP_SHARE = 0.25
RSS_TOLERANCE = 0.05
# The host prompt cache may grow up to its bound after warm-up: that growth is not a leak.
CACHE_RAM_MIB = 16
# Hang guard for one request; a request that takes longer is a failure.
REQUEST_TIMEOUT = 120.0
HEALTH_FAST = 1.0  # seconds, the slowest /health answer allowed while the soak runs
HEALTH_IDLE_FAST = 0.25  # and once it is over
DRAIN_TIMEOUT = 4.0
IN_FLIGHT_MARGIN = 1.0  # seconds
# Streams that run past the drain in the SIGTERM test (a sequence there holds 512 tokens).
LONG_STREAMS = 4
LONG_STREAM_TOKENS = 480
SHUTTING_DOWN = "server_shutting_down"

PROMPTS = [
    "Name three colors.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Tell me a joke about llamas.",
    "List the days of the week.",
    "Explain rain to a child in one sentence.",
]
SYSTEM = "You are a helpful assistant who answers briefly."
# Some prompts are long runs of random words: their prefill is long enough to be abandoned in.
LONG_PROMPT_SHARE = 0.1
LONG_PROMPT_WORDS = 300
WORDS = "river stone cloud lamp garden paper window orange music winter bridge candle forest".split()
MALFORMED = [
    b"{not json",
    b"[1, 2, 3]",
    b'{"messages": "hello"}',
    b'{"messages": [{"role": "wizard", "content": "hi"}]}',
    b'{"prompt": 5}',
    b'{"prompt": "hi", "temperature": "hot"}',
    b'{"prompt": "hi", "max_tokens": -3}',
    b'{"prompt": "hi", "stop": ' + json.dumps(["x"] * 10_000).encode() + b"}",
    b'{"prompt": "\\ud800"}',
    b"",
]


# -- one client's requests ----------------------------------------------------------------------


@dataclass
class Tally:
    """What the clients saw, shared between their threads."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    kinds: collections.Counter[str] = field(default_factory=collections.Counter)
    abandoned: collections.Counter[str] = field(default_factory=collections.Counter)
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    completed: int = 0
    signalled_at: float | None = None  # when SIGTERM was sent, if it was

    def sent_well_before_signal(self, started: float) -> bool:
        """A request sent this long before SIGTERM had surely reached the server: it was in
        flight when the drain began, and must be answered."""
        return self.signalled_at is None or started < self.signalled_at - IN_FLIGHT_MARGIN

    def add(self, counter: str, key: Any) -> None:
        with self.lock:
            getattr(self, counter)[key] += 1

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)


def make_body(rng: random.Random, chat: bool, stream: bool, *, long: bool | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": rng.randint(1, MAX_TOKENS), "stream": stream}
    prompt = rng.choice(PROMPTS)
    if rng.random() < LONG_PROMPT_SHARE if long is None else long:  # a prefill that takes a while
        prompt = " ".join(rng.choices(WORDS, k=LONG_PROMPT_WORDS)) + " " + prompt
    if chat:
        messages = [{"role": "user", "content": prompt}]
        if rng.random() < 0.5:  # a shared prefix, for the prefix cache
            messages.insert(0, {"role": "system", "content": SYSTEM})
        if rng.random() < 0.3:  # a later turn of a conversation
            messages += [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": rng.choice(PROMPTS)}]
        body["messages"] = messages
    else:
        body["prompt"] = (SYSTEM + " " if rng.random() < 0.5 else "") + prompt
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body["temperature"] = round(rng.uniform(0.2, 1.2), 2)
        body["seed"] = rng.randrange(2**32)
    if rng.random() < 0.2:
        body["stop"] = [rng.choice([".", "\n", " the", "3"])]
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.1:
        body["logit_bias"] = NO_END_TOKENS
    return body


def path_of(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def check_completion(body: dict[str, Any], request: dict[str, Any], chat: bool) -> None:
    assert body["object"] == ("chat.completion" if chat else "text_completion"), body
    [choice] = body["choices"]
    assert choice["finish_reason"] in {"stop", "length"}, body
    text = choice["message"]["content"] if chat else choice["text"]
    assert isinstance(text, str)
    usage = body["usage"]
    assert 1 <= usage["completion_tokens"] <= request["max_tokens"], usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def check_stream(raw: bytes, request: dict[str, Any], chat: bool, *, allow_shutdown: bool = False) -> str:
    """A complete stream: one finish_reason, usage when asked; returns how it ended."""
    stream = sse.parse(raw, errors=True, kind="chat" if chat else "completion")
    chunks, error = stream.chunks, stream.error
    if error is not None:
        assert allow_shutdown and error["code"] == SHUTTING_DOWN, error
        return "ended by shutdown"
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}, chunks[0]
    finishes = [c for c in chunks if sse.finish_reason(c)]
    assert len(finishes) == 1, chunks[-3:]
    if request.get("stream_options", {}).get("include_usage"):
        usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and chunks[-2] is finishes[0]
        assert 1 <= usage["completion_tokens"] <= request["max_tokens"], usage
    else:
        assert chunks[-1] is finishes[0]
    return "done"


class Client:
    """One soak client: a thread issuing requests until its deadline (or until refused)."""

    def __init__(self, index: int, url: str, port: int, tally: Tally, *, seed: int, shutdown: threading.Event) -> None:
        self.rng = random.Random(seed * 1000 + index)
        self.url = url
        self.port = port
        self.tally = tally
        self.shutdown = shutdown  # set once SIGTERM has been sent
        self.http = httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT)

    def run(self, deadline: float) -> None:
        try:
            while time.monotonic() < deadline:
                if not self.one():
                    return
        finally:
            self.http.close()

    def one(self) -> bool:
        """One request; False once the server refuses connections (it is shutting down)."""
        rng = self.rng
        chat = rng.random() < 0.5
        roll = rng.random()
        started = time.monotonic()
        try:
            if roll < 0.06:
                self.malformed(chat)
            elif roll < 0.06 + 0.34:
                self.abandon(chat)
            else:
                self.complete(chat, rng.random() < 0.5)
        except (httpx.ConnectError, ConnectionRefusedError) as exc:
            if self.shutdown.is_set():
                self.tally.add("outcomes", "refused after SIGTERM")
                return False
            self.tally.fail(f"cannot connect: {exc!r}")
        except (httpx.TransportError, OSError) as exc:
            # At a drain's start the server closes idle keep-alive connections; a request sent
            # on one at that moment gets no answer at all (a partial one is a failure, below).
            if self.shutdown.is_set() and not self.tally.sent_well_before_signal(started):
                self.tally.add("outcomes", "connection closed at drain start")
            else:
                self.tally.fail(f"{exc!r}")
        return True

    # -- the kinds of request --

    def complete(self, chat: bool, stream: bool) -> None:
        body = make_body(self.rng, chat, stream)
        kind = f"{'chat' if chat else 'completion'} {'streamed' if stream else 'whole'}"
        self.tally.add("kinds", kind)
        answered = False
        try:
            if stream:
                with self.http.stream("POST", path_of(chat), json=body) as response:
                    answered = True
                    self.tally.add("statuses", response.status_code)
                    raw = response.read()
                    if response.status_code == 200:
                        ending = check_stream(raw, body, chat, allow_shutdown=self.shutdown.is_set())
                        self.tally.add("outcomes", ending)
                    else:
                        self.shutdown_refusal(response.status_code, json.loads(raw), kind)
            else:
                response = self.http.post(path_of(chat), json=body)
                self.tally.add("statuses", response.status_code)
                if response.status_code == 200:
                    check_completion(response.json(), body, chat)
                    self.tally.add("outcomes", "done")
                else:
                    self.shutdown_refusal(response.status_code, response.json(), kind)
            with self.tally.lock:
                self.tally.completed += 1
        except httpx.TransportError as exc:
            if answered:  # a stream cut short: never acceptable
                self.tally.fail(f"{kind}: stream cut: {exc!r} for {body}")
                return
            raise
        except AssertionError as exc:
            self.tally.fail(f"{kind}: malformed answer: {exc} for {body}")

    def shutdown_refusal(self, status: int, payload: dict[str, Any], kind: str) -> None:
        if self.shutdown.is_set() and status == 503 and payload["error"]["code"] == SHUTTING_DOWN:
            self.tally.add("outcomes", "refused: shutting down")
        else:
            self.tally.fail(f"{kind}: status {status}: {payload}")

    def malformed(self, chat: bool) -> None:
        rng = self.rng
        payload = rng.choice(MALFORMED)
        if rng.random() < 0.2:  # a body cut short: promised, never sent; then gone
            self.tally.add("kinds", "cut-short body")
            with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
                cut = payload[: len(payload) // 2]
                sock.sendall(request_bytes("POST", path_of(chat), cut, content_length=len(payload) + 10, host="soak"))
                time.sleep(rng.uniform(0, 0.2))
            return
        self.tally.add("kinds", "malformed")
        response = self.http.post(path_of(chat), content=payload, headers={"content-type": "application/json"})
        self.tally.add("statuses", response.status_code)
        error = response.json().get("error", {})
        if response.status_code != 400 or set(error) != {"message", "type", "param", "code"}:
            if not (self.shutdown.is_set() and response.status_code == 503):
                self.tally.fail(f"malformed {payload[:80]!r}: {response.status_code} {response.text[:300]}")

    def abandon(self, chat: bool) -> None:
        rng = self.rng
        when = rng.choice(
            [
                "after sending",
                "after a short wait",
                "in a long prefill",
                "mid-stream",
                "after the last token",
                "mid-body",
            ]
        )
        stream = when in {"mid-stream", "after the last token"} or rng.random() < 0.5
        # A long prompt, left at a random moment within a queue wait: often during its prefill.
        body = make_body(rng, chat, stream, long=when == "in a long prefill")
        self.tally.add("abandoned", when)
        if when in {"after sending", "after a short wait", "in a long prefill"}:
            with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
                sock.sendall(request_bytes("POST", path_of(chat), body, host="soak"))
                if when == "after a short wait":
                    time.sleep(rng.uniform(0.02, 1.0))
                elif when == "in a long prefill":
                    time.sleep(rng.uniform(0.5, 10.0))
            return
        if when == "mid-body":  # a non-streamed request given up while it generates
            timeout = httpx.Timeout(10, read=rng.uniform(0.05, 1.5))
            body["stream"] = False
            try:
                response = self.http.post(path_of(chat), json=body, timeout=timeout)
            except httpx.ReadTimeout:
                return
            self.tally.add("statuses", response.status_code)  # it was quicker than the client
            return
        with self.http.stream("POST", path_of(chat), json=body) as response:
            self.tally.add("statuses", response.status_code)
            if response.status_code != 200:
                return
            wanted = rng.randint(1, 8)
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if when == "mid-stream":
                    wanted -= 1
                    if wanted <= 0:
                        break
                elif event.get("choices") and event["choices"][0]["finish_reason"]:
                    break
        # leaving the block closes the connection before [DONE]


# -- the server and what it reports -----------------------------------------------------------


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class HealthProbe:
    """Polls /health on a fresh connection every 0.25 s and keeps the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.slowest = 0.0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                status = httpx.get(self.url + "/health", timeout=30).status_code
                if status != 200:
                    self.failures.append(f"/health {status}")
            except httpx.TransportError as exc:
                self.failures.append(repr(exc))
            self.slowest = max(self.slowest, time.monotonic() - started)
            self._stop.wait(0.25)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(35)


def wait_idle(server: ServerProcess, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (
            m["llama_trio_active_sequences"] == 0
            and m["llama_trio_queue_depth"] == 0
            and m["llama_trio_paused_sequences"] == 0
            and m["llama_trio_kv_cells_used"] == m["llama_trio_kv_cells_cached"]
        ):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine did not come back to idle: {m}")
        time.sleep(0.1)


def server_args(*extra: str, max_tokens: int = MAX_TOKENS) -> list[str]:
    # One llama.cpp thread: on two shared cores, two threads that wait for each other at every
    # step are many times slower as soon as anything else runs. Batches of 128: a long prompt
    # takes several steps to prefill, so that clients can leave during its prefill.
    return [
        *("--parallel", "8", "--ctx-size", "4096", "--batch-size", "128", "--threads", "1"),
        *("--max-queue", "64", "--max-tokens", str(max_tokens), "--cache-ram", str(CACHE_RAM_MIB)),
        *extra,
    ]


def run_clients(
    server: ServerProcess, tally: Tally, seconds: float, *, seed: int, shutdown: threading.Event
) -> list[threading.Thread]:
    deadline = time.monotonic() + seconds
    clients = [Client(i, server.url, server.port, tally, seed=seed, shutdown=shutdown) for i in range(CLIENTS)]
    threads = [threading.Thread(target=c.run, args=(deadline,), name=f"soak-{i}") for i, c in enumerate(clients)]
    for thread in threads:
        thread.start()
    return threads


def long_stream(url: str, endings: list[str], tally: Tally) -> None:
    """A stream too long to finish within the drain: it must end with the shutdown error event
    and [DONE]."""
    body = {
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": LONG_STREAM_TOKENS,
        "stream": True,
        "logit_bias": NO_END_TOKENS,
    }
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT) as response:
            assert response.status_code == 200
            endings.append(check_stream(response.read(), body, chat=True, allow_shutdown=True))
    except (AssertionError, httpx.TransportError) as exc:
        tally.fail(f"long stream: {exc!r}")


@pytest.fixture
def soak_seconds(request: pytest.FixtureRequest) -> float:
    return float(request.config.getoption("soak_seconds"))


@pytest.fixture
def soak_server() -> Iterator[ServerProcess]:
    with ServerProcess(server_args()) as proc:
        proc.wait_ready()
        yield proc


# -- the tests ----------------------------------------------------------------------------------


def test_soak(soak_server: ServerProcess, soak_seconds: float) -> None:
    server = soak_server
    pid = server.proc.pid
    tally = Tally()
    started = time.monotonic()
    with HealthProbe(server.url) as health:
        threads = run_clients(server, tally, soak_seconds, seed=1, shutdown=threading.Event())
        time.sleep(soak_seconds * WARM_UP_SHARE)
        rss_warm = rss_bytes(pid)
        rss_peak = rss_warm
        while any(t.is_alive() for t in threads):
            rss_peak = max(rss_peak, rss_bytes(pid))
            time.sleep(0.5)
            assert time.monotonic() - started < soak_seconds + REQUEST_TIMEOUT, "soak clients hung"
        health_slowest = health.slowest
    elapsed = time.monotonic() - started
    m = wait_idle(server)
    idle_health = time.monotonic()
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    idle_health = time.monotonic() - idle_health
    rss_after = rss_bytes(pid)
    server_5xx = {
        k: v for k, v in m.items() if k.startswith("llama_trio_requests_total{endpoint=/v1") and ",status=5" in k
    }
    cancels = {p: m[f"llama_trio_cancellations_total{{phase={p}}}"] for p in ("queued", "prefill", "generate")}
    requests = sum(tally.kinds.values()) + sum(tally.abandoned.values())
    print(
        f"\nsoak: {requests} requests in {elapsed:.0f} s by {CLIENTS} clients; kinds {dict(tally.kinds)}; "
        f"abandoned {dict(tally.abandoned)}; engine cancellations by phase {cancels}; "
        f"statuses seen {dict(sorted(tally.statuses.items()))}; outcomes {dict(tally.outcomes)}; "
        f"server 5xx {server_5xx or 0}; RSS warm {rss_warm / 2**20:.1f} MiB, peak {rss_peak / 2**20:.1f} MiB, "
        f"after {rss_after / 2**20:.1f} MiB; /health slowest {health_slowest * 1000:.0f} ms during, "
        f"{idle_health * 1000:.0f} ms after; failures {len(tally.failures)}"
    )
    assert not tally.failures, "\n".join(tally.failures[:20])
    assert not health.failures, health.failures[:5]
    assert not server_5xx, server_5xx
    assert not any(500 <= s for s in tally.statuses), tally.statuses
    assert tally.completed >= CLIENTS, f"only {tally.completed} requests completed"
    assert cancels["queued"] + cancels["prefill"] + cancels["generate"] > 0
    assert rss_after <= rss_warm * (1 + RSS_TOLERANCE) + CACHE_RAM_MIB * 2**20, (rss_warm, rss_after)
    assert health_slowest < HEALTH_FAST, health_slowest
    assert idle_health < HEALTH_IDLE_FAST, idle_health
    assert server.stop() == 0
    assert "Traceback" not in server.log and " ERROR " not in server.log, server.log[-5000:]


def test_sigterm_in_the_middle_of_the_soak(soak_seconds: float) -> None:
    """Every open stream ends well-formed (done, or an error event and [DONE]); the process
    exits within the drain timeout + 1 s; a new instance binds the same port and serves."""
    load = min(10.0, soak_seconds / 4)
    with ServerProcess(server_args("--drain-timeout", str(DRAIN_TIMEOUT), max_tokens=LONG_STREAM_TOKENS)) as server:
        server.wait_ready()
        port = server.port
        tally = Tally()
        shutdown = threading.Event()
        long_endings: list[str] = []
        long_streams = [
            threading.Thread(target=long_stream, args=(server.url, long_endings, tally)) for _ in range(LONG_STREAMS)
        ]
        for thread in long_streams:
            thread.start()
        threads = run_clients(server, tally, load + DRAIN_TIMEOUT + 30, seed=2, shutdown=shutdown)
        time.sleep(load)
        open_streams = server.metrics()["llama_trio_active_sequences"]
        signalled = tally.signalled_at = time.monotonic()
        shutdown.set()
        server.send_signal(signal.SIGTERM)
        code = server.wait(DRAIN_TIMEOUT + 30)
        exited = time.monotonic() - signalled
        for thread in threads + long_streams:
            thread.join(REQUEST_TIMEOUT)
            assert not thread.is_alive(), "a soak client hung after the server exited"
        log = server.log
    print(
        f"\nsigterm: {open_streams:.0f} sequences active at the signal; exit {code} after {exited:.2f} s "
        f"(drain timeout {DRAIN_TIMEOUT} s); kinds {dict(tally.kinds)}; abandoned {dict(tally.abandoned)}; "
        f"statuses {dict(sorted(tally.statuses.items()))}; outcomes {dict(tally.outcomes)}; "
        f"long streams {long_endings}; failures {len(tally.failures)}"
    )
    assert code == 0, log[-3000:]
    assert len(long_endings) == LONG_STREAMS and "ended by shutdown" in long_endings, long_endings
    assert exited <= DRAIN_TIMEOUT + 1.0, f"exited {exited:.2f} s after SIGTERM"
    assert not tally.failures, "\n".join(tally.failures[:20])
    assert tally.outcomes["refused after SIGTERM"] > 0
    assert "Traceback" not in log, log[-5000:]
    # A new instance binds the port and serves at once.
    restarted = time.monotonic()
    with ServerProcess(server_args(), port=port) as again:
        again.wait_ready()
        body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        response = httpx.post(again.url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 200
        served_after = time.monotonic() - restarted
        assert again.stop() == 0
    assert served_after < 15, served_after
