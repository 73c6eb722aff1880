"""The serving benchmark's measurements of one launched server (a ``Session``), each returning
what the results record: aggregate throughput, TTFT, the second chat turn, CPU after a client
disconnects, SIGTERM with streams in flight, our constraint counters; and the waits around them:
for a quiet machine (``wait_quiet``, ``guarded``) and for an idle server (``wait_idle``).
"""

from __future__ import annotations

import contextlib
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import trio

from bench.support.client import StreamResult, get_body
from bench.support.servers import plain_bind_outcome
from bench.support.workload import (
    CHAT_INSTRUCTIONS,
    FOLLOW_UP,
    LONG_MAX_TOKENS,
    MAX_TOKENS,
    TTFT_MAX_TOKENS,
    TURN1_MAX_TOKENS,
    TURN2_MAX_TOKENS,
    Session,
)
from tests.support.ports import time_wait_on

TTFT_STAGGER_S = 0.1
PIECES_BEFORE_DISCONNECT = 16
PIECES_BEFORE_SIGTERM = 8
# The CPU counters tick every 10 ms; a server is idle when they stand still this long.
IDLE_WINDOW_S = 0.5
IDLE_SAMPLE_S = 0.02
IDLE_GIVE_UP_S = 60.0
EXIT_TIMEOUT_S = 90.0  # both drain or give up well within this (ours: --drain-timeout 30 s)
# Before each timed measurement: wait until other processes have been quiet for QUIET_S (at
# most QUIET_GIVE_UP_S), since a test suite running beside us can cut llama.cpp's speed tenfold.
QUIET_S = 2.0
QUIET_PROBE_S = 0.5
QUIET_GIVE_UP_S = 300.0


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``statistics.quantiles`` with the inclusive method)."""
    if len(values) == 1:
        return values[0]
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[int(q) - 1]


def check_streams(results: Sequence[StreamResult], max_tokens: int, what: str) -> None:
    """Raise unless every stream got a 200, ``max_tokens`` tokens and a well-formed end."""
    for r in results:
        if r.failure or r.status != 200 or r.completion_tokens != max_tokens or not r.well_formed:
            raise RuntimeError(
                f"{what}: a stream failed: status={r.status} failure={r.failure} tokens={r.completion_tokens} "
                f"finish={r.finish_reason} done={r.done} clean_end={r.clean_end} error={r.error}"
            )


async def measure_throughput(
    session: Session, concurrency: int, waves: int, response_format: Any = None, max_tokens: int = MAX_TOKENS
) -> dict[str, Any]:
    """``concurrency`` clients, each sending ``waves`` requests of ``max_tokens`` one after
    another: completion tokens / wall time from the first request to the end of the last."""
    results: list[StreamResult] = []

    async def client() -> None:
        for _ in range(waves):
            results.append(await session.chat(max_tokens, response_format))

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)
    wall = time.perf_counter() - start
    check_streams(results, max_tokens, f"throughput at {concurrency}")
    tokens = sum(r.completion_tokens for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "tps": tokens / wall,
    }


async def measure_ttft(session: Session, concurrency: int, requests: int) -> dict[str, Any]:
    """``concurrency`` clients started ``TTFT_STAGGER_S`` apart, each sending ``requests``
    requests of ``TTFT_MAX_TOKENS``: p50 and p95 of request sent to first content."""
    results: list[StreamResult] = []

    async def client(i: int) -> None:
        await trio.sleep(i * TTFT_STAGGER_S)
        for _ in range(requests):
            results.append(await session.chat(TTFT_MAX_TOKENS))

    async with trio.open_nursery() as nursery:
        for i in range(concurrency):
            nursery.start_soon(client, i)
    check_streams(results, TTFT_MAX_TOKENS, f"TTFT at {concurrency}")
    ttfts = [r.ttft for r in results if r.ttft is not None]
    return {
        "concurrency": concurrency,
        "samples": ttfts,
        "p50_s": percentile(ttfts, 50),
        "p95_s": percentile(ttfts, 95),
    }


async def measure_ttft_busy(session: Session, concurrency: int, requests: int) -> dict[str, Any]:
    """``measure_ttft`` while another process keeps one core busy (``busy_neighbour``). Its
    CPU time is this process's waited-for child's, so ``guarded`` does not count it as other
    load."""
    with busy_neighbour():
        return await measure_ttft(session, concurrency, requests)


@contextlib.contextmanager
def busy_neighbour() -> Iterator[subprocess.Popen[bytes]]:
    """A process that spins on one core for as long as the block runs (killed and reaped at its
    end): the neighbour a shared machine has, which takes a core from the server's threads."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
    try:
        yield spinner
    finally:
        spinner.kill()
        spinner.wait()


async def measure_second_turn(session: Session, conversations: int) -> dict[str, Any]:
    """TTFT of a first turn with a long system prompt, then of the second turn that repeats
    it (both servers can reuse the first turn's cached prefix); medians over
    ``conversations``."""
    out: list[dict[str, Any]] = []
    for _ in range(conversations):
        messages = session.messages()
        messages[0]["content"] += " " + CHAT_INSTRUCTIONS
        turn1 = await session.send(messages, TURN1_MAX_TOKENS)
        check_streams([turn1], TURN1_MAX_TOKENS, "turn 1")
        messages += [{"role": "assistant", "content": turn1.text}, {"role": "user", "content": FOLLOW_UP}]
        turn2 = await session.send(messages, TURN2_MAX_TOKENS)
        check_streams([turn2], TURN2_MAX_TOKENS, "turn 2")
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
    """CPU seconds the server spends after a client closes a long stream mid-way, and the time
    until it stops."""
    # Idle first, so that what follows the disconnect is the disconnect's own cost.
    await wait_idle(session, time.perf_counter(), session.cpu_seconds())
    result = await session.chat(LONG_MAX_TOKENS, stop_after_pieces=PIECES_BEFORE_DISCONNECT)
    since, cpu = time.perf_counter(), session.cpu_seconds()
    if result.pieces < PIECES_BEFORE_DISCONNECT:
        raise RuntimeError(f"the stream to cut ended early: {result}")
    return {"pieces_before": result.pieces, **await wait_idle(session, since, cpu)}


async def measure_sigterm(session: Session) -> dict[str, Any]:
    """SIGTERM with 2 long streams in flight: seconds to exit, how each stream ended, whether
    a plain bind of the port succeeds at once. The server is gone afterwards."""
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
    streams = [_stream_ending(r, signalled) for r in results]
    return {
        "exit_s": exit_s,
        "exit_code": session.proc.returncode,
        "streams": streams,
        "well_formed": sum(s["well_formed"] for s in streams),
        "plain_bind": bind,
        "time_wait_on_port": time_wait,
    }


def _stream_ending(r: StreamResult, signalled: float) -> dict[str, Any]:
    return {
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


def _wait_exit(proc: subprocess.Popen[bytes], since: float) -> float | None:
    try:
        proc.wait(EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None
    return time.perf_counter() - since


async def constraint_counters(port: int) -> tuple[float, float]:
    """Our /metrics: (tokens sampled under a grammar, seconds their masks took)."""
    values = {}
    for line in (await get_body(port, "/metrics")).decode().splitlines():
        name, _, value = line.partition(" ")
        if name in {"llama_trio_constrained_tokens_total", "llama_trio_constraint_seconds_total"}:
            values[name] = float(value)
    return values["llama_trio_constrained_tokens_total"], values["llama_trio_constraint_seconds_total"]


async def wait_quiet(session: Session, max_foreign: float) -> float:
    """``common.wait_for_quiet`` without blocking the event loop (the server's own CPU use does
    not count as foreign)."""
    start = time.perf_counter()
    quiet_since = start
    while time.perf_counter() - start < QUIET_GIVE_UP_S:
        watch = session.cpu_watch()
        await trio.sleep(QUIET_PROBE_S)
        if (watch.foreign_cores() or 0.0) > max_foreign:
            quiet_since = time.perf_counter()
        elif time.perf_counter() - quiet_since >= QUIET_S:
            break
    return time.perf_counter() - start


async def guarded(
    session: Session,
    what: str,
    measurement: Callable[[], Awaitable[dict[str, Any]]],
    *,
    max_foreign: float,
    retries: int,
) -> dict[str, Any]:
    """``measurement()`` once the machine is quiet, again (at most ``retries`` times) while
    other processes kept more than ``max_foreign`` cores busy during it; the result records
    their load, the wait and the attempt."""
    for attempt in range(retries + 1):
        waited = await wait_quiet(session, max_foreign)
        measured = session.cpu_watch()
        result = await measurement()
        result.update(foreign_cores=measured.foreign_cores(), waited_for_quiet_s=waited, attempt=attempt + 1)
        if (result["foreign_cores"] or 0.0) <= max_foreign:
            break
        print(f"  {session.server.side}: other processes were busy during {what}; measuring it again", flush=True)
    return result
