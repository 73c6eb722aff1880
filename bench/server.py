"""Side by side: our server (``python -m server``) vs llama.cpp's ``llama-server``, over HTTP.

Both servers run the same model from the same pinned llama.cpp build with the same shape:
``PARALLEL`` sequences (16), ``CTX`` KV cells in all (8192, so 512 per sequence, one KV stream
per sequence: llama-server gets ``--no-kv-unified``, ours never unifies), the same threads,
n_batch = n_ubatch = 512, flash attention on auto, everything on the CPU. llama-server also gets
``--no-webui``; its other defaults stay (prompt cache on, ``--cache-ram`` 8 GiB, ``--poll 50``).
One server process serves every concurrency level of a run (parallel 16 for 1, 4 and 16
streams), as a deployment would.

The load generator is this one process: trio, raw sockets, a small HTTP/1.1 reader (chunked or
Content-Length bodies) and an SSE splitter; one TCP connection per request, which the client
closes after the body's end (so TIME_WAIT sockets land on the client's ports, not the server's).
Every request is a streamed chat completion at temperature 0 with ``stream_options.
include_usage``; its system message starts with a request number, so no two prompts share more
than a few tokens and neither server answers from its prompt cache unless a test means it to.
End-of-generation tokens get a logit bias of -100, so every stream runs to ``max_tokens`` and
both servers generate the same number of tokens.

One run of a side starts a fresh server and measures, in this order:

- startup: seconds from launch to the first 200 on ``/health``;
- aggregate completion tokens/s at 1, 4 and 16 concurrent streams: that many clients, each
  sending ``--waves`` requests of ``MAX_TOKENS`` (128) one after another; completion tokens
  (from ``usage``) / wall time from the first request to the end of the last stream;
- TTFT (request sent to the first non-empty content delta, connect included) p50 and p95 at
  1 and 4 concurrent streams: clients start 0.1 s apart and each sends ``--ttft-requests``
  requests of 16 tokens;
- TTFT of a second chat turn (with a system prompt of about 250 tokens): turn 1 (64 tokens),
  then turn 2 = turn 1's messages + the assistant's answer + a new user message; both servers
  can reuse turn 1's cached prefix;
- CPU seconds the server spends after a client disconnects mid-stream (a 384-token stream
  closed after 16 pieces): utime + stime from ``/proc/PID/stat``, sampled every 20 ms until it
  stops rising for 0.5 s, and the time until it stopped;
- peak RSS (``VmHWM``), read after all of the above;
- SIGTERM with 2 streams (384 tokens) in flight: seconds to exit, whether each stream was
  well formed (a ``finish_reason`` or an error event, then ``data: [DONE]``, then the end of the
  chunked body) and whether a plain ``bind`` of the port (no ``SO_REUSEADDR``) succeeds at once.

Sides alternate for ``--runs`` runs each, the first side flipping every run (llama-server,
ours, ours, llama-server, ...). The
machine may be shared: before each throughput, TTFT and second-turn measurement the benchmark
waits until other processes keep at most ``--max-foreign`` cores busy, and repeats the
measurement (at most ``--retries`` times) when they were busier than that while it ran; their
average load is recorded with every measurement and for the whole run.

    python -m bench.server [--runs 4] [--threads 2] [--waves 2] [--ttft-requests 8]

Writes ``bench/results/server.md``, ``server.png`` and ``server.json``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import trio

from bench import common
from tests.support.ports import free_port, plain_bind, time_wait_on

LLAMA_SERVER = "llama-server"
MEASURES = "our HTTP server vs llama-server: throughput, TTFT, prefix reuse, memory, disconnects, SIGTERM, startup"
SIDES = ("llama-server", "ours")

PARALLEL = 16  # sequences (slots) on both servers, for every concurrency level
CTX = 8192  # KV cells in all: 512 per sequence
BATCH = 512  # n_batch = n_ubatch on both (ours: --batch-size; n_ubatch follows it)
CONCURRENCY = (1, 4, 16)
TTFT_CONCURRENCY = (1, 4)
JSON_CONCURRENCY = (1, 4)
# Structured-output streams: an answer this schema allows is longer than MAX_TOKENS on both
# servers (at least 100 numbers), so every stream runs to MAX_TOKENS as the free ones do.
JSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "numbers",
        "schema": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 100},
    },
}
MAX_TOKENS = 128  # throughput requests
TTFT_MAX_TOKENS = 16
TURN1_MAX_TOKENS = 64
TURN2_MAX_TOKENS = 8
LONG_MAX_TOKENS = 384  # disconnect and SIGTERM streams: long enough to be cut mid-way
TTFT_STAGGER_S = 0.1
PIECES_BEFORE_DISCONNECT = 16
PIECES_BEFORE_SIGTERM = 8
# The CPU counters tick every 10 ms; a server is idle when they stand still this long.
IDLE_WINDOW_S = 0.5
IDLE_SAMPLE_S = 0.02
IDLE_GIVE_UP_S = 60.0
STARTUP_TIMEOUT_S = 120.0
EXIT_TIMEOUT_S = 90.0  # both drain or give up well within this (ours: --drain-timeout 30 s)
HEALTH_POLL_S = 0.02
# Before each timed measurement: wait until other processes have been quiet for QUIET_S (at
# most QUIET_GIVE_UP_S), since a test suite running beside us can cut llama.cpp's speed tenfold.
QUIET_S = 2.0
QUIET_PROBE_S = 0.5
QUIET_GIVE_UP_S = 300.0

QUESTIONS = (
    "Explain how a refrigerator keeps food cold, step by step, for a curious twelve-year-old.",
    "Describe the water cycle and why it matters for farming, with a few concrete examples.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between a list and a tuple in Python, and when would you use each?",
    "Give practical advice for someone learning to cook simple, healthy meals at home.",
    "Summarise the history of the bicycle from its invention to the present day.",
    "Explain why the sky is blue and why sunsets are red, without using equations.",
    "Plan a relaxing weekend trip to the mountains for two people on a small budget.",
)
FOLLOW_UP = "Thank you. Now summarise your answer in one sentence."
# The system prompt of the two-turn chats: real assistants carry a few hundred tokens of
# instructions, and that shared prefix is what a second turn should not compute again (about
# 230 tokens here, so that both turns fit in a sequence's 512 cells).
CHAT_INSTRUCTIONS = " ".join(
    [
        "Answer in plain English, in short paragraphs, and keep a friendly, patient tone.",
        "When a question is ambiguous, say which reading you chose and why before answering.",
        "Prefer concrete examples over abstract statements, and numbers over vague words.",
        "Never invent sources, quotations, statistics or names; say so when you do not know.",
        "If the user asks for code, give a short, complete example and explain each part.",
        "If the user asks for a summary, keep it to the points that change a decision.",
        "Use metric units first and give imperial units in parentheses when they help.",
        "Avoid jargon; when a technical term is needed, define it the first time it appears.",
        "Check arithmetic twice and show the steps of any calculation that matters.",
        "Keep lists short: three to five items, each a full sentence with a verb.",
        "When safety is involved, such as electricity, chemicals or medicine, say so clearly.",
        "Do not repeat the question back; start with the answer, then give the reasons.",
        "If the user writes in another language, answer in that language.",
        "End with one question that would help the user go further, when it is useful.",
    ]
)


# -- a minimal HTTP/1.1 + SSE client --------------------------------------------------------


class _Reader:
    """Buffered reads from a trio stream."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()
        self.eof = False

    async def _fill(self) -> bool:
        data = await self.stream.receive_some(65536)
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    async def until(self, marker: bytes) -> bytes | None:
        """Bytes up to and including ``marker``; None at EOF first."""
        while True:
            i = self.buf.find(marker)
            if i >= 0:
                out = bytes(self.buf[: i + len(marker)])
                del self.buf[: i + len(marker)]
                return out
            if not await self._fill():
                return None

    async def exactly(self, n: int) -> bytes | None:
        while len(self.buf) < n:
            if not await self._fill():
                return None
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def some(self) -> bytes:
        if not self.buf and not await self._fill():
            return b""
        out = bytes(self.buf)
        self.buf.clear()
        return out


async def _head(reader: _Reader) -> tuple[int, dict[str, str]]:
    raw = await reader.until(b"\r\n\r\n")
    if raw is None:
        raise ConnectionError("connection closed before a response")
    lines = raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        key, sep, value = line.partition(":")
        if sep:
            headers[key.strip().lower()] = value.strip()
    return status, headers


async def _body_parts(reader: _Reader, headers: dict[str, str], result: StreamResult | None = None) -> Any:
    """The body's bytes as they arrive. Sets ``result.clean_end`` when the body ended as
    framed (the last chunk of a chunked body, or all of Content-Length)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            line = await reader.until(b"\r\n")
            if line is None:
                return
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.until(b"\r\n")  # (no trailers from either server)
                if result is not None:
                    result.clean_end = True
                return
            data = await reader.exactly(size + 2)
            if data is None:
                return
            yield data[:-2]
    elif "content-length" in headers:
        data = await reader.exactly(int(headers["content-length"]))
        if data is None:
            return
        if result is not None:
            result.clean_end = True
        yield data
    else:
        while chunk := await reader.some():
            yield chunk


@dataclass
class StreamResult:
    """What one streamed chat completion delivered; times from ``time.perf_counter``."""

    sent: float = 0.0
    first_content: float | None = None
    end: float | None = None
    status: int | None = None
    pieces: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: Any = None
    done: bool = False  # saw data: [DONE]
    clean_end: bool = False  # the body ended as framed
    events_after_done: int = 0
    usage: dict[str, Any] | None = None
    failure: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_content is None else self.first_content - self.sent

    @property
    def completion_tokens(self) -> int:
        return int((self.usage or {}).get("completion_tokens", 0))

    @property
    def well_formed(self) -> bool:
        """Ended by itself in the protocol's terms: a finish_reason or an error event, then
        [DONE] and nothing after it, then the body's proper end."""
        return (
            (self.finish_reason is not None or self.error is not None)
            and self.done
            and self.events_after_done == 0
            and self.clean_end
        )


def chat_body(
    messages: list[dict[str, str]], max_tokens: int, banned: Sequence[int], response_format: Any = None
) -> bytes:
    payload: dict[str, Any] = {
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": {str(t): -100 for t in banned},
    }
    if response_format is not None:
        payload["response_format"] = response_format
    return json.dumps(payload).encode()


def _handle_event(result: StreamResult, data: str, now: float) -> None:
    if result.done:
        result.events_after_done += 1
        return
    if data == "[DONE]":
        result.done = True
        return
    obj = json.loads(data)
    if "error" in obj:
        result.error = obj["error"]
        return
    if obj.get("usage"):
        result.usage = obj["usage"]
    for choice in obj.get("choices") or ():
        content = (choice.get("delta") or {}).get("content")
        if content:
            if result.first_content is None:
                result.first_content = now
            result.pieces += 1
            result.text += content
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]


async def stream_chat(
    port: int,
    body: bytes,
    *,
    stop_after_pieces: int | None = None,
    on_pieces: Callable[[StreamResult], None] | None = None,
) -> StreamResult:
    """POST a streamed chat completion and read it to its end (or, with ``stop_after_pieces``,
    close the connection abruptly after that many content pieces). ``on_pieces`` is called
    after each content piece. Never raises for what the server does."""
    result = StreamResult(sent=time.perf_counter())
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError as exc:
        result.failure = f"connect: {exc}"
        return result
    async with stream:
        try:
            await stream.send_all(head + body)
            reader = _Reader(stream)
            result.status, headers = await _head(reader)
            pending = b""
            async with contextlib.aclosing(_body_parts(reader, headers, result)) as parts:
                async for part in parts:
                    now = time.perf_counter()
                    pending += part
                    *events, pending = pending.replace(b"\r\n", b"\n").split(b"\n\n")
                    for event in events:
                        for line in event.split(b"\n"):
                            if line.startswith(b"data:"):
                                before = result.pieces
                                _handle_event(result, line[5:].strip().decode(), now)
                                if result.pieces != before and on_pieces is not None:
                                    on_pieces(result)
                    if stop_after_pieces is not None and result.pieces >= stop_after_pieces:
                        break  # leaving the block closes the socket mid-stream
        except (OSError, ConnectionError, trio.BrokenResourceError, ValueError) as exc:
            result.failure = f"{type(exc).__name__}: {exc}"
    result.end = time.perf_counter()
    return result


async def constraint_counters(port: int) -> tuple[float, float]:
    """Our /metrics: (tokens sampled under a grammar, seconds their masks took). The client
    closes first, as everywhere here, so that no TIME_WAIT lands on the server's port."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        reader = _Reader(stream)
        _status, headers = await _head(reader)
        data = b"".join([part async for part in _body_parts(reader, headers)])
    values = {}
    for line in data.decode().splitlines():
        name, _, value = line.partition(" ")
        if name in {"llama_trio_constrained_tokens_total", "llama_trio_constraint_seconds_total"}:
            values[name] = float(value)
    return values["llama_trio_constrained_tokens_total"], values["llama_trio_constraint_seconds_total"]


async def get_status(port: int, path: str) -> int | None:
    """Status of ``GET path``, or None when nothing answers."""
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        return None
    async with stream:
        try:
            await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            reader = _Reader(stream)
            status, headers = await _head(reader)
            async for _ in _body_parts(reader, headers):
                pass
            return status
        except (OSError, ConnectionError, trio.BrokenResourceError, ValueError):
            return None


# -- the servers ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    threads: int
    waves: int
    ttft_requests: int
    conversations: int
    max_foreign: float = 0.25
    retries: int = 2


def server_command(
    side: str,
    exe: pathlib.Path,
    model_path: pathlib.Path,
    cfg: Config,
    port: int,
    *,
    parallel: int = PARALLEL,
    ctx: int = CTX,
) -> list[str]:
    if side == "llama-server":
        return [
            str(exe),
            "-m", str(model_path),
            "--host", "127.0.0.1",
            "--port", str(port),
            "-np", str(parallel),
            "-c", str(ctx),  # all slots together, as ours
            "--no-kv-unified",  # one KV stream per slot, as ours
            "-t", str(cfg.threads),
            "-tb", str(cfg.threads),
            "-b", str(BATCH),
            "-ub", str(BATCH),
            "-ngl", "0",
            "--no-webui",
        ]  # fmt: skip
    return [
        sys.executable, "-m", "server",
        "--model", str(model_path),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--parallel", str(parallel),
        "--ctx-size", str(ctx),
        "--threads", str(cfg.threads),
        "--batch-size", str(BATCH),
    ]  # fmt: skip


def vm_hwm_bytes(pid: int) -> int | None:
    """Peak resident set size of a live process (``VmHWM``)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def plain_bind_outcome(port: int) -> str:
    """ "ok", or the errno name of a bind of 127.0.0.1:port without SO_REUSEADDR (what the
    results record)."""
    failure = plain_bind(port)
    if failure is None:
        return "ok"
    return errno.errorcode.get(failure.errno or 0, str(failure))


def _percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``statistics.quantiles`` with the inclusive method)."""
    if len(values) == 1:
        return values[0]
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[int(q) - 1]


class Session:
    """One launched server and the requests sent to it."""

    def __init__(self, port: int, proc: subprocess.Popen[bytes], banned: Sequence[int]) -> None:
        self.port = port
        self.proc = proc
        self.banned = banned
        self._n = 0

    def messages(self, question: str | None = None) -> list[dict[str, str]]:
        """A fresh conversation: a system message that starts with a request number."""
        self._n += 1
        q = question or QUESTIONS[self._n % len(QUESTIONS)]
        return [
            {"role": "system", "content": f"Request {self._n}. You are a helpful assistant."},
            {"role": "user", "content": q},
        ]

    async def chat(self, max_tokens: int, response_format: Any = None, **kw: Any) -> StreamResult:
        body = chat_body(self.messages(), max_tokens, self.banned, response_format)
        return await stream_chat(self.port, body, **kw)

    def cpu_seconds(self) -> float:
        return common.process_cpu_seconds(self.proc.pid)


def _check(results: Sequence[StreamResult], max_tokens: int, what: str) -> None:
    for r in results:
        if r.failure or r.status != 200 or r.completion_tokens != max_tokens or not r.well_formed:
            raise RuntimeError(
                f"{what}: a stream failed: status={r.status} failure={r.failure} tokens={r.completion_tokens} "
                f"finish={r.finish_reason} done={r.done} clean_end={r.clean_end} error={r.error}"
            )


async def measure_startup(port: int, started: float, proc: subprocess.Popen[bytes]) -> float:
    deadline = started + STARTUP_TIMEOUT_S
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} while starting")
        if await get_status(port, "/health") == 200:
            return time.perf_counter() - started
        await trio.sleep(HEALTH_POLL_S)
    raise RuntimeError(f"no 200 on /health within {STARTUP_TIMEOUT_S} s")


async def measure_throughput(
    session: Session, concurrency: int, waves: int, response_format: Any = None
) -> dict[str, Any]:
    results: list[StreamResult] = []

    async def client() -> None:
        for _ in range(waves):
            results.append(await session.chat(MAX_TOKENS, response_format))

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)
    wall = time.perf_counter() - start
    _check(results, MAX_TOKENS, f"throughput at {concurrency}")
    tokens = sum(r.completion_tokens for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "tps": tokens / wall,
    }


async def measure_ttft(session: Session, concurrency: int, requests: int) -> dict[str, Any]:
    results: list[StreamResult] = []

    async def client(i: int) -> None:
        await trio.sleep(i * TTFT_STAGGER_S)
        for _ in range(requests):
            results.append(await session.chat(TTFT_MAX_TOKENS))

    async with trio.open_nursery() as nursery:
        for i in range(concurrency):
            nursery.start_soon(client, i)
    _check(results, TTFT_MAX_TOKENS, f"TTFT at {concurrency}")
    ttfts = [r.ttft for r in results if r.ttft is not None]
    return {
        "concurrency": concurrency,
        "samples": ttfts,
        "p50_s": _percentile(ttfts, 50),
        "p95_s": _percentile(ttfts, 95),
    }


async def measure_second_turn(session: Session, conversations: int) -> dict[str, Any]:
    out = []
    for _ in range(conversations):
        messages = session.messages()
        messages[0]["content"] += " " + CHAT_INSTRUCTIONS
        turn1 = await stream_chat(session.port, chat_body(messages, TURN1_MAX_TOKENS, session.banned))
        _check([turn1], TURN1_MAX_TOKENS, "turn 1")
        messages += [{"role": "assistant", "content": turn1.text}, {"role": "user", "content": FOLLOW_UP}]
        turn2 = await stream_chat(session.port, chat_body(messages, TURN2_MAX_TOKENS, session.banned))
        _check([turn2], TURN2_MAX_TOKENS, "turn 2")
        usage = turn2.usage or {}
        out.append(
            {
                "turn1_ttft_s": turn1.ttft,
                "turn2_ttft_s": turn2.ttft,
                "turn2_prompt_tokens": usage.get("prompt_tokens"),
                "turn2_cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            }
        )
    return {
        "conversations": out,
        "turn1_ttft_s": statistics.median(c["turn1_ttft_s"] for c in out),
        "turn2_ttft_s": statistics.median(c["turn2_ttft_s"] for c in out),
    }


async def wait_idle(session: Session, since: float, cpu_since: float) -> dict[str, Any]:
    """Sample the server's CPU time until it stands still for IDLE_WINDOW_S."""
    last_cpu, last_change = cpu_since, since
    while True:
        await trio.sleep(IDLE_SAMPLE_S)
        now = time.perf_counter()
        cpu = session.cpu_seconds()
        if cpu > last_cpu:
            last_cpu, last_change = cpu, now
        elif now - last_change >= IDLE_WINDOW_S:
            return {"cpu_s": last_cpu - cpu_since, "idle_after_s": last_change - since, "idle": True}
        if now - since > IDLE_GIVE_UP_S:
            return {"cpu_s": cpu - cpu_since, "idle_after_s": now - since, "idle": False}


async def measure_disconnect(session: Session) -> dict[str, Any]:
    # Idle first, so that what follows the disconnect is the disconnect's own cost.
    await wait_idle(session, time.perf_counter(), session.cpu_seconds())
    result = await session.chat(LONG_MAX_TOKENS, stop_after_pieces=PIECES_BEFORE_DISCONNECT)
    since, cpu = time.perf_counter(), session.cpu_seconds()
    if result.pieces < PIECES_BEFORE_DISCONNECT:
        raise RuntimeError(f"the stream to cut ended early: {result}")
    return {"pieces_before": result.pieces, **await wait_idle(session, since, cpu)}


async def measure_sigterm(session: Session) -> dict[str, Any]:
    results: list[StreamResult] = []
    ready = trio.Event()
    counts = [0, 0]

    def progress(i: int) -> Callable[[StreamResult], None]:
        def seen(r: StreamResult) -> None:
            counts[i] = r.pieces
            if min(counts) >= PIECES_BEFORE_SIGTERM:
                ready.set()

        return seen

    async def client(i: int) -> None:
        results.append(await session.chat(LONG_MAX_TOKENS, on_pieces=progress(i)))

    signalled = 0.0
    exit_s: float | None = None
    async with trio.open_nursery() as nursery:
        for i in range(2):
            nursery.start_soon(client, i)
        with trio.fail_after(60):
            await ready.wait()
        signalled = time.perf_counter()
        session.proc.send_signal(signal.SIGTERM)
        exit_s = await trio.to_thread.run_sync(_wait_exit, session.proc, signalled)
        bind = plain_bind_outcome(session.port)  # at once: the streams may still be finishing their reads
        time_wait = len(time_wait_on(session.port))
    streams = [
        {
            "well_formed": r.well_formed,
            "finish_reason": r.finish_reason,
            "error_code": (r.error or {}).get("code") if isinstance(r.error, dict) else r.error,
            "done": r.done,
            "clean_end": r.clean_end,
            "completion_tokens": r.completion_tokens,
            "pieces": r.pieces,
            "stream_ended_after_signal_s": None if r.end is None else r.end - signalled,
            "failure": r.failure,
        }
        for r in results
    ]
    return {
        "exit_s": exit_s,
        "exit_code": session.proc.returncode,
        "streams": streams,
        "well_formed": sum(s["well_formed"] for s in streams),
        "plain_bind": bind,
        "time_wait_on_port": time_wait,
    }


def cpu_watch(session: Session) -> common.CpuWatch:
    return common.CpuWatch([session.proc.pid])


async def wait_quiet(session: Session, max_foreign: float) -> float:
    """``common.wait_for_quiet`` without blocking the event loop (the server's own CPU use does
    not count as foreign)."""
    start = time.perf_counter()
    quiet_since = start
    while time.perf_counter() - start < QUIET_GIVE_UP_S:
        watch = cpu_watch(session)
        await trio.sleep(QUIET_PROBE_S)
        if (watch.foreign_cores() or 0.0) > max_foreign:
            quiet_since = time.perf_counter()
        elif time.perf_counter() - quiet_since >= QUIET_S:
            break
    return time.perf_counter() - start


def _wait_exit(proc: subprocess.Popen[bytes], since: float) -> float | None:
    try:
        proc.wait(EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None
    return time.perf_counter() - since


def run_side(
    side: str, exe: pathlib.Path, model_path: pathlib.Path, cfg: Config, banned: Sequence[int], logdir: pathlib.Path
) -> dict[str, Any]:
    """Launch one server, measure everything, stop it with SIGTERM."""
    port = free_port()
    command = server_command(side, exe, model_path, cfg, port)
    log = (logdir / f"{side}-{port}.log").open("wb")
    load = common.load_average()
    started = time.perf_counter()
    proc = subprocess.Popen(
        command, cwd=common.REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
    )
    watch = common.CpuWatch([proc.pid])
    session = Session(port, proc, banned)
    out: dict[str, Any] = {"side": side, "port": port, "load_average": load}

    async def guarded(what: str, fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
        for attempt in range(cfg.retries + 1):
            waited = await wait_quiet(session, cfg.max_foreign)
            measured = cpu_watch(session)
            result: dict[str, Any] = await fn(*args)
            result.update(foreign_cores=measured.foreign_cores(), waited_for_quiet_s=waited, attempt=attempt + 1)
            if (result["foreign_cores"] or 0.0) <= cfg.max_foreign:
                break
            print(f"  {side}: other processes were busy during {what}; measuring it again", flush=True)
        return result

    async def measure() -> None:
        out["startup_s"] = await measure_startup(port, started, proc)
        await session.chat(TTFT_MAX_TOKENS)  # warm-up
        out["throughput"] = [
            await guarded(f"throughput at {c}", measure_throughput, session, c, cfg.waves) for c in CONCURRENCY
        ]
        out["ttft"] = [
            await guarded(f"TTFT at {c}", measure_ttft, session, c, cfg.ttft_requests) for c in TTFT_CONCURRENCY
        ]
        before = await constraint_counters(port) if side == "ours" else None
        out["json_throughput"] = [
            await guarded(f"json_schema throughput at {c}", measure_throughput, session, c, cfg.waves, JSON_FORMAT)
            for c in JSON_CONCURRENCY
        ]
        if before is not None:
            after = await constraint_counters(port)
            tokens = after[0] - before[0]
            out["constraint_us_per_token"] = 1e6 * (after[1] - before[1]) / tokens if tokens else None
        out["second_turn"] = await guarded("the second turn", measure_second_turn, session, cfg.conversations)
        out["disconnect"] = await measure_disconnect(session)
        out["peak_rss_bytes"] = vm_hwm_bytes(proc.pid)
        out["foreign_cores"] = watch.foreign_cores()
        out["sigterm"] = await measure_sigterm(session)

    try:
        trio.run(measure)
    except BaseException:
        log.flush()
        tail = (logdir / f"{side}-{port}.log").read_text(errors="replace")[-3000:]
        print(f"--- {side} log tail ---\n{tail}", file=sys.stderr)
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    return out


# -- report ---------------------------------------------------------------------------------

# (key, label, unit, how to read a value out of a run, digits, higher is better)
Metric = tuple[str, str, str, Callable[[dict[str, Any]], float | None], int, bool]


def _metrics() -> list[Metric]:
    metrics: list[Metric] = []
    for i, c in enumerate(CONCURRENCY):
        metrics.append(
            (f"tps_{c}", f"completion tokens/s, {c} stream{'s' if c > 1 else ''}", "tok/s",
             lambda r, i=i: r["throughput"][i]["tps"], 1, True)
        )  # fmt: skip
    for i, c in enumerate(JSON_CONCURRENCY):
        metrics.append(
            (f"json_tps_{c}", f"json_schema completion tokens/s, {c} stream{'s' if c > 1 else ''}", "tok/s",
             lambda r, i=i: r["json_throughput"][i]["tps"], 1, True)
        )  # fmt: skip
    for i, c in enumerate(TTFT_CONCURRENCY):
        for q in ("p50", "p95"):
            metrics.append(
                (f"ttft_{q}_{c}", f"TTFT {q}, {c} stream{'s' if c > 1 else ''}", "ms",
                 lambda r, i=i, q=q: 1000 * r["ttft"][i][f"{q}_s"], 0, False)
            )  # fmt: skip
    metrics += [
        ("turn1_ttft", "TTFT, first chat turn", "ms", lambda r: 1000 * r["second_turn"]["turn1_ttft_s"], 0, False),
        ("turn2_ttft", "TTFT, second turn (shared prefix)", "ms",
         lambda r: 1000 * r["second_turn"]["turn2_ttft_s"], 0, False),
        ("rss", "peak RSS (VmHWM)", "MiB", lambda r: r["peak_rss_bytes"] / 2**20, 0, False),
        ("disconnect_cpu", "CPU after a client disconnects", "s", lambda r: r["disconnect"]["cpu_s"], 2, False),
        ("disconnect_idle", "time until idle after the disconnect", "s",
         lambda r: r["disconnect"]["idle_after_s"], 2, False),
        ("sigterm_exit", "SIGTERM with 2 streams: seconds to exit", "s", lambda r: r["sigterm"]["exit_s"], 2, False),
        ("startup", "startup: launch to first 200 on /health", "s", lambda r: r["startup_s"], 2, False),
    ]  # fmt: skip
    return metrics


def summarise_metrics(runs: list[dict[str, Any]], metrics: Sequence[Metric]) -> dict[str, Any]:
    """Per metric: each side's median (min-max) over ``runs`` and the ratio of the medians."""
    summary: dict[str, Any] = {}
    for key, label, unit, get, _digits, higher in metrics:
        entry: dict[str, Any] = {"label": label, "unit": unit, "higher_is_better": higher}
        for side in SIDES:
            values = [v for r in runs if r["side"] == side and (v := get(r)) is not None]
            entry[side] = common.Summary.of(values).as_dict() if values else None
        if entry["ours"] and entry["llama-server"] and entry["llama-server"]["median"]:
            entry["ratio"] = entry["ours"]["median"] / entry["llama-server"]["median"]
        summary[key] = entry
    return summary


def metric_rows(summary: dict[str, Any], metrics: Sequence[Metric]) -> list[list[str]]:
    """One table row per metric: label, each side's median (min-max), the ratio."""
    rows = []
    for key, label, unit, _get, digits, _higher in metrics:
        entry = summary[key]
        cells = [f"{label} ({unit})"]
        for side in SIDES:
            s = entry[side]
            cells.append(common.Summary(s["median"], s["min"], s["max"], s["n"]).format(digits) if s else "-")
        ratio = entry.get("ratio")
        cells.append(f"{ratio:.2f}" if ratio is not None else "-")
        rows.append(cells)
    return rows


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary = summarise_metrics(runs, _metrics())
    ours_free = {c: summary[f"tps_{c}"]["ours"] for c in JSON_CONCURRENCY}
    ours_json = {c: summary[f"json_tps_{c}"]["ours"] for c in JSON_CONCURRENCY}
    summary["json_vs_free"] = {
        str(c): ours_json[c]["median"] / ours_free[c]["median"]
        for c in JSON_CONCURRENCY
        if ours_json[c] and ours_free[c]
    }
    costs = [r["constraint_us_per_token"] for r in runs if r.get("constraint_us_per_token") is not None]
    summary["constraint_us_per_token"] = common.Summary.of(costs).as_dict() if costs else None
    for side in SIDES:
        sig = [r["sigterm"] for r in runs if r["side"] == side]
        summary[f"sigterm_{side}"] = {
            "well_formed_streams": sum(s["well_formed"] for s in sig),
            "streams": sum(len(s["streams"]) for s in sig),
            "plain_bind_ok": sum(s["plain_bind"] == "ok" for s in sig),
            "plain_bind_results": [s["plain_bind"] for s in sig],
            "runs": len(sig),
            "exit_codes": [s["exit_code"] for s in sig],
            "stream_endings": sorted(
                {f"{st['finish_reason'] or st['error_code'] or 'cut'}" for s in sig for st in s["streams"]}
            ),
        }
    return summary


def markdown(summary: dict[str, Any], runs: int, info: dict[str, Any]) -> str:
    rows = metric_rows(summary, _metrics())
    for label, field_ in (
        ("SIGTERM: streams well formed (finish or error event, [DONE], body end)", "well_formed_streams"),
        ("SIGTERM: plain bind of the port right after exit succeeds", "plain_bind_ok"),
    ):
        cells = [label]
        for side in SIDES:
            s = summary[f"sigterm_{side}"]
            total = s["streams"] if field_ == "well_formed_streams" else s["runs"]
            cells.append(f"{s[field_]}/{total}")
        cells.append("")
        rows.append(cells)
    header = ["measure", "llama-server", "ours", "ours / llama-server (medians)"]
    m = info["machine"]
    dirty = " (with uncommitted changes to server/ or ffi/)" if info["git"]["dirty"] else ""
    endings = {side: ", ".join(summary[f"sigterm_{side}"]["stream_endings"]) for side in SIDES}
    binds = {side: ", ".join(summary[f"sigterm_{side}"]["plain_bind_results"]) for side in SIDES}
    lines = [
        f"Median (min-max) of {runs} runs per side, alternating (ABBA); one fresh server per run with "
        f"{PARALLEL} sequences, {CTX} KV cells ({CTX // PARALLEL} per sequence, not unified), "
        f"{info['config']['threads']} threads, batch {BATCH}; streamed chat, temperature 0, "
        f"{MAX_TOKENS} tokens per request for throughput ({info['config']['waves']} requests per stream), "
        f"{TTFT_MAX_TOKENS} for TTFT. Ratios above 1 are better for tokens/s, below 1 for everything else.",
        "",
        common.markdown_table(header, rows),
        "",
        "json_schema streams (an array of at least 100 integers, so every stream runs to "
        f"{MAX_TOKENS} tokens): ours constrained / ours free, medians: "
        + ", ".join(f"{v:.2f} at {c}" for c, v in summary["json_vs_free"].items())
        + "; our mask cost per constrained token (mean of a run, median of runs): "
        + (f"{summary['constraint_us_per_token']['median']:.0f} us." if summary["constraint_us_per_token"] else "-."),
        "",
        f"SIGTERM stream endings: llama-server: {endings['llama-server']}; ours: {endings['ours']}. "
        f"Plain bind after exit: llama-server: {binds['llama-server']}; ours: {binds['ours']}.",
        "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores ({m['cores_usable']} usable), {m['system']}, "
        f"Python {m['python']}. Other processes' load during the runs: at most "
        f"{info['max_foreign_cores']:.2f} cores (average over a run).",
        f"Versions: ours {info['git']['commit'][:12]}{dirty}; "
        f"llama.cpp {info['llama_cpp'].get('package', '')} {info['llama_cpp'].get('version', '')} "
        f"(both servers built from it; llama-server reports: {info['llama_server_version']}).",
    ]
    return "\n".join(lines)


def chart(summary: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [
        ("Throughput (tok/s, higher is better)", [f"tps_{c}" for c in CONCURRENCY], [f"{c} str." for c in CONCURRENCY]),
        (
            "TTFT (ms)",
            ["ttft_p50_1", "ttft_p95_1", "ttft_p50_4", "ttft_p95_4", "turn1_ttft", "turn2_ttft"],
            ["p50 @1", "p95 @1", "p50 @4", "p95 @4", "turn 1", "turn 2"],
        ),
        ("Peak RSS (MiB)", ["rss"], [""]),
        ("After a disconnect (s)", ["disconnect_cpu", "disconnect_idle"], ["CPU", "to idle"]),
        ("SIGTERM, 2 streams (s)", ["sigterm_exit"], ["to exit"]),
        ("Startup (s)", ["startup"], ["to /health 200"]),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    colours = {"llama-server": "#4c72b0", "ours": "#dd8452"}
    for ax, (title, keys, labels) in zip(axes.flat, groups, strict=True):
        width = 0.38
        for j, side in enumerate(SIDES):
            xs, heights, lows, highs = [], [], [], []
            for i, key in enumerate(keys):
                s = summary[key][side]
                if s is None:
                    continue
                xs.append(i + (j - 0.5) * width)
                heights.append(s["median"])
                lows.append(s["median"] - s["min"])
                highs.append(s["max"] - s["median"])
            ax.bar(xs, heights, width, yerr=[lows, highs], capsize=3, label=side, color=colours[side])
        ax.set_xticks(range(len(keys)), labels)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend()
    fig.suptitle("llama-trio vs llama-server: median of runs, bars show min-max")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def end_of_generation_tokens(model_path: pathlib.Path) -> list[int]:
    """End-of-generation token ids of the model (banned in every request)."""
    import ffi

    with ffi.Model(model_path) as model:
        vocab = model.vocab
        return sorted(vocab.eog_tokens)


def main(argv: list[str] | None = None) -> None:
    parser = common.parser(
        MEASURES,
        tool=LLAMA_SERVER,
        runs_default=4,
        runs_help="runs per side, alternating ABBA",
        retries_default=2,
        max_foreign_help="wait for, and measure again after, other processes using more cores than this",
    )
    parser.add_argument("--waves", type=int, default=2, help="throughput requests per stream (default 2)")
    parser.add_argument("--ttft-requests", type=int, default=8, help="TTFT requests per stream (default 8)")
    parser.add_argument("--conversations", type=int, default=3, help="two-turn chats per run (default 3)")
    args = parser.parse_args(argv)
    if min(args.runs, args.threads, args.waves, args.ttft_requests, args.conversations) < 1:
        parser.error("--runs, --threads, --waves, --ttft-requests and --conversations must be at least 1")

    cfg = Config(args.threads, args.waves, args.ttft_requests, args.conversations, args.max_foreign, args.retries)
    model_path = common.model_path(args.model)
    exe = common.llama_tool(LLAMA_SERVER, build=not args.no_build)
    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    llama_server_version = " ".join((version.stdout + version.stderr).split())
    banned = end_of_generation_tokens(model_path)
    machine = common.machine_info()

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        for i in range(args.runs):
            # ABBA: the side that goes first flips every run, so neither always follows the other.
            for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                run = run_side(side, exe, model_path, cfg, banned, pathlib.Path(tmp))
                run["order"] = len(runs) + 1
                tps = " ".join(f"{t['tps']:.0f}" for t in run["throughput"])
                print(
                    f"run {i + 1}/{args.runs} {side:<12} tok/s@{'/'.join(map(str, CONCURRENCY))} {tps}  "
                    f"startup {run['startup_s']:.2f}s  sigterm exit {run['sigterm']['exit_s']}  "
                    f"(other load {run['foreign_cores'] or 0.0:.2f} cores)",
                    flush=True,
                )
                runs.append(run)

    summary = summarise(runs)
    info = {
        "config": asdict(cfg),
        "machine": machine,
        "git": common.git_version(),
        "llama_cpp": common.llama_pin(),
        "llama_server_version": llama_server_version,
        "max_foreign_cores": max((r.get("foreign_cores") or 0.0) for r in runs),
    }
    table = markdown(summary, args.runs, info)
    print()
    print(table)
    common.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (common.RESULTS_DIR / "server.md").write_text(table + "\n", encoding="utf-8")
    chart(summary, common.RESULTS_DIR / "server.png")
    path = common.write_results(
        "server",
        {
            "benchmark": "server",
            "measures": MEASURES,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **info,
            "load_average_after": common.load_average(),
            "model": str(model_path),
            "banned_tokens": banned,
            "shape": {"parallel": PARALLEL, "ctx": CTX, "batch": BATCH, "max_tokens": MAX_TOKENS},
            "commands": {side: server_command(side, exe, model_path, cfg, 0) for side in SIDES},  # port: per run
            "runs": runs,
            "summary": summary,
        },
    )
    print(f"\nwrote {path.relative_to(common.REPO_ROOT)}, server.md and server.png")


if __name__ == "__main__":
    main()
