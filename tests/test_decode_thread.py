"""``DecodeThread``: the engine's one thread for llama.cpp calls (no model needed)."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from server.engine import DecodeThread


async def test_runs_calls_on_one_thread_and_returns_or_raises() -> None:
    worker = DecodeThread()
    try:
        idents = {await worker.run(threading.get_ident) for _ in range(5)}
        assert len(idents) == 1 and threading.get_ident() not in idents
        assert await worker.run(divmod, 17, 5) == (3, 2)
        with pytest.raises(ZeroDivisionError):
            await worker.run(divmod, 1, 0)
        assert await worker.run(sum, [1, 2, 3]) == 6  # still usable after an error
    finally:
        worker.close()


async def test_cancellation_waits_for_the_call_in_progress() -> None:
    """A cancelled caller returns only once the call has finished (never abandoned), and the
    thread then serves the next call with its own result, not the cancelled one's."""
    worker = DecodeThread()
    finished: list[float] = []

    def slow() -> str:
        time.sleep(0.3)
        finished.append(time.monotonic())
        return "slow"

    try:
        with trio.move_on_after(0.05) as scope:
            await worker.run(slow)
        returned = time.monotonic()
        assert scope.cancelled_caught
        assert finished and finished[0] <= returned
        assert await worker.run(str.upper, "next") == "NEXT"
    finally:
        worker.close()


async def test_already_cancelled_caller_never_starts_the_call() -> None:
    worker = DecodeThread()
    ran: list[int] = []
    try:
        with trio.CancelScope() as scope:
            scope.cancel()
            await worker.run(ran.append, 1)
        assert ran == []
    finally:
        worker.close()


def test_close_is_idempotent_and_ends_the_thread() -> None:
    worker = DecodeThread()
    thread = worker._thread
    worker.close()
    worker.close()
    assert not thread.is_alive()
