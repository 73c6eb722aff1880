"""``DecodeThread``: the one thread that makes the engine's long llama.cpp calls."""

from __future__ import annotations

import collections
import queue
import socket
import threading
from collections.abc import Callable
from typing import Any

import trio

_DONE, _POSTED = b"\0", b"\1"  # what the thread writes to the socket: a call's end, an item posted


class DecodeThread:
    """The one thread that makes the engine's long llama.cpp calls (creating the context, every
    decode step); ``await run(fn, *args)`` runs ``fn`` there and returns its result.

    Why not ``trio.to_thread.run_sync``: (1) its thread cache may hand a step to a different
    thread than the last one, and llama.cpp's OpenMP build keeps a thread team per calling
    thread (measured: decoding from a second thread while the first is alive ran 30-50 %
    slower); (2) its result comes back through ``run_sync_soon`` (one scheduler batch for the
    entry-queue task, then another for the caller); here the thread writes one byte to a socket
    the caller waits on, which wakes the caller directly (~150 vs ~280 us on the dev VM).

    *Cancellation*: a call in progress is never abandoned (the thread may hold llama.cpp
    state): a cancelled caller goes on waiting, shielded, until the call returns, then raises
    ``Cancelled``; a caller cancelled before it starts never hands the call over. One call at
    a time. ``close()`` ends the thread once its current call returns;
    idempotent.

    ``run_posting`` is ``run`` for a call that reports as it goes: ``fn`` gets a ``post(item)``
    to call in the thread, and the caller gets each item as soon as its task wakes, while the
    call runs on (the engine's chained steps, ``chain.run_chain``).
    """

    def __init__(self, name: str = "llama-trio-decode") -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._done_recv, self._done_send = socket.socketpair()
        self._done_recv.setblocking(False)
        self._result: tuple[bool, Any] | None = None
        self._busy = False
        self._posts: collections.deque[Any] = collections.deque()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, args = call
            try:
                self._result = (True, fn(*args))
            except BaseException as exc:  # handed to the caller, raised there
                self._result = (False, exc)
            self._done_send.send(_DONE)

    def _post(self, item: Any) -> None:
        """In the thread: hand ``item`` to the caller of ``run_posting`` now."""
        self._posts.append(item)
        self._done_send.send(_POSTED)

    async def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        meanwhile: Callable[[], None] | None = None,
        stop: Callable[[], None] | None = None,
    ) -> Any:
        """``fn(*args)`` in the thread; ``meanwhile()``, when given, runs here (synchronously)
        once the call is handed over, while it runs. ``stop()``, when given, is called if the
        caller is cancelled meanwhile, to ask ``fn`` to return soon (``Context.interrupt``)."""
        return await self.run_posting(
            _without_posts, fn, args, take=_take_nothing, stop=stop or _nothing, meanwhile=meanwhile
        )

    async def run_posting(
        self,
        fn: Callable[..., Any],
        *args: Any,
        take: Callable[[list[Any], bool], None],
        stop: Callable[[], None],
        meanwhile: Callable[[], None] | None = None,
    ) -> Any:
        """``fn(*args, post)`` in the thread; each item it posts reaches ``take(items, done)``
        here, in order, a batch per wake-up (``done``: the call has returned, nothing more
        comes), then ``fn``'s result is returned as by ``run``.

        *Cancellation*: as ``run``'s, and ``stop()`` is called first, to ask ``fn`` to return
        soon; items posted meanwhile still reach ``take``.
        """
        if self._busy:
            raise RuntimeError("DecodeThread.run is not reentrant")
        await trio.lowlevel.checkpoint_if_cancelled()
        self._busy = True
        self._calls.put((fn, (*args, self._post)))
        try:
            try:
                if meanwhile is not None:
                    meanwhile()
                while not await self._take_posts(take):
                    pass
            except BaseException:  # cancelled: the call goes on; wait for it, then re-raise
                stop()
                with trio.CancelScope(shield=True):
                    while not await self._take_posts(take):
                        pass
                raise
        finally:
            self._busy = False
        assert self._result is not None
        (ok, value), self._result = self._result, None
        if not ok:
            raise value
        return value

    async def _take_posts(self, take: Callable[[list[Any], bool], None]) -> bool:
        """Wait for the thread's next signal; hand what it posted to ``take``. True: its call returned."""
        await trio.lowlevel.wait_readable(self._done_recv)
        # A byte per post and one for the end; the thread runs at most a post or two ahead.
        done = _DONE in self._done_recv.recv(4096)  # every post before the end is in the deque by now
        posts = []
        while self._posts:
            posts.append(self._posts.popleft())
        if posts or done:
            take(posts, done)
        return done

    def close(self) -> None:
        if self._thread.is_alive():
            self._calls.put(None)
            self._thread.join()
        self._done_recv.close()
        self._done_send.close()


def _without_posts(fn: Callable[..., Any], args: tuple[Any, ...], post: Callable[[Any], None]) -> Any:
    return fn(*args)


def _take_nothing(items: list[Any], done: bool) -> None:
    assert not items, "a plain call posts nothing"


def _nothing() -> None:
    pass
