"""``GrammarCompiler``: grammar compiles admitted like any other work.

A compile is C work of up to a fraction of a second (``grammar_limits`` bounds it) that must run
on a thread with a large stack. Here:

- a grammar already compiled in the caller's scope is answered at once, on the event loop;
- otherwise its compile waits in a FIFO queue for one of ``threads`` compile threads, each made
  for one compile with a stack of ``COMPILE_STACK_BYTES``. Compiles waiting count with the
  engine's queue against ``max_queue``; past it, ``Overloaded`` (a 503 with Retry-After);
- callers asking for the same grammar in the same scope at once share one compile;
- a caller that stops waiting (a client gone, a deadline) leaves the queue; a compile that has
  started runs to its end in its thread, still holding its place among the ``threads`` (so
  abandoned compiles cannot pile up), and its result is kept in the cache;
- ``stop`` (a shutdown's drain) ends every wait with an error at once; ``wait_idle`` waits,
  bounded, for compiles still running, which read the vocabulary: the model is freed after.
"""

from __future__ import annotations

import collections
import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from server.engine.grammar import CacheKey, Grammar, GrammarCache, GrammarError, GrammarKind
from server.engine.grammar_limits import COMPILE_STACK_BYTES, COMPILE_THREADS
from server.engine.jobs import EngineError, Overloaded, ShuttingDown

logger = logging.getLogger("llama_trio.grammar")


@dataclass
class CompileStats:
    """What the compiler has done; read it, never write it."""

    waiting: int = 0  # compiles queued for a thread
    running: int = 0  # compiles in a thread (abandoned ones too)
    cache_hits: int = 0  # grammars answered from the cache
    compiles: int = 0  # compiles run
    failures: int = 0  # of those, grammars refused (a 400)
    overloaded: int = 0  # compiles refused because the queue was full
    abandoned: int = 0  # waits that ended before their compile did (a client gone)
    seconds: float = 0.0  # time in compile threads, all compiles together


@dataclass(eq=False)
class _Compile:
    """One compile and the callers waiting for it."""

    key: CacheKey
    done: trio.Event = field(default_factory=trio.Event)
    result: Grammar | None = None
    error: BaseException | None = None
    waiters: int = 0
    started: bool = False


class GrammarCompiler:
    """Compiles grammars for one tokenizer (``cache``) on bounded threads. Used from the event
    loop only (its methods are not thread-safe); the threads report back through it."""

    def __init__(
        self, cache: GrammarCache, *, queued: Callable[[], int], max_queue: int, threads: int = COMPILE_THREADS
    ) -> None:
        self._cache = cache
        self._queued = queued  # the engine's queue, which compiles waiting count with
        self._max_queue = max_queue
        self._threads = threads
        self._pending: collections.deque[_Compile] = collections.deque()
        self._current: dict[CacheKey, _Compile] = {}  # queued or running
        self._stopped: EngineError | None = None
        self._idle = trio.Event()
        self._idle.set()
        self._token = trio.lowlevel.current_trio_token()
        self.stats = CompileStats()

    async def compile(self, kind: GrammarKind, source: str, scope: str) -> Grammar:
        """The grammar for ``source`` in ``scope``: from the cache, or compiled in turn.

        Raises ``GrammarError`` (the grammar cannot be compiled), ``Overloaded`` (too many
        compiles and jobs waiting), ``ShuttingDown`` (after ``stop``).

        *Cancellation*: a caller cancelled while its compile waits for a thread takes it out of
        the queue (unless others wait for it too); once it runs, the compile finishes in its
        thread without it, and its grammar is cached.
        """
        key = (scope, kind, source)
        if self._stopped is not None:
            raise copy.copy(self._stopped)
        grammar = self._cache.get(key)
        if grammar is not None:
            self.stats.cache_hits += 1
            return grammar
        job = self._current.get(key)
        if job is None:
            if len(self._pending) + self._queued() >= self._max_queue:
                self.stats.overloaded += 1
                raise Overloaded("the request queue is full; retry later")
            job = self._current[key] = _Compile(key)
            self._pending.append(job)
            self._start_next()
        job.waiters += 1
        try:
            await job.done.wait()
        finally:
            job.waiters -= 1
            if not job.done.is_set():
                self.stats.abandoned += 1
                if job.waiters == 0 and not job.started:
                    self._pending.remove(job)
                    del self._current[key]
                self._update()
        if job.error is not None:
            raise copy.copy(job.error)  # each caller its own, with its own traceback
        assert job.result is not None
        return job.result

    def stop(self, error: EngineError | None = None) -> None:
        """No more compiles: every caller waiting now, or calling later, gets ``error`` (by
        default ``ShuttingDown``). Compiles already running finish in their threads."""
        self._stopped = error or ShuttingDown("server is shutting down")
        for job in list(self._current.values()):
            job.error = self._stopped
            job.done.set()
        self._pending.clear()
        self._current.clear()
        self._update()

    async def wait_idle(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the compiles still running; whether none is.

        *Cancellation*: shielded; the wait is bounded by ``seconds`` alone.
        """
        with trio.CancelScope(shield=True), trio.move_on_after(seconds):
            await self._idle.wait()
        return self._idle.is_set()

    # -- the threads -------------------------------------------------------------------------

    def _start_next(self) -> None:
        while self._pending and self.stats.running < self._threads:
            job = self._pending.popleft()
            job.started = True
            self.stats.running += 1
            self._idle = trio.Event() if self._idle.is_set() else self._idle
            # The stack size is process-wide and read when a thread is made; every Python thread
            # of this process is made from the event loop's thread, so no other gets this one.
            previous = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                threading.Thread(target=self._run, args=(job,), name="llama-trio-grammar", daemon=True).start()
            finally:
                threading.stack_size(previous)
        self._update()

    def _run(self, job: _Compile) -> None:
        """In a compile thread: compile, then report to the event loop."""
        _, kind, source = job.key
        started = time.perf_counter()
        result: Grammar | None = None
        error: BaseException | None = None
        try:
            result = self._cache.build(kind, source)
        except GrammarError as exc:
            error = exc
        except Exception as exc:  # a bug: reported to the caller as one, never lost in the thread
            logger.exception("grammar compile failed")
            error = exc
        try:
            self._token.run_sync_soon(self._finished, job, result, error, time.perf_counter() - started)
        except trio.RunFinishedError:
            pass  # the event loop is gone: nobody waits

    def _finished(self, job: _Compile, result: Grammar | None, error: BaseException | None, seconds: float) -> None:
        stats = self.stats
        stats.running -= 1
        stats.compiles += 1
        stats.failures += isinstance(error, GrammarError)
        stats.seconds += seconds
        if result is not None:
            self._cache.put(job.key, result)
        if self._current.get(job.key) is job:
            del self._current[job.key]
            job.result, job.error = result, error
            job.done.set()
        if stats.running == 0:
            self._idle.set()
        self._start_next()

    def _update(self) -> None:
        self.stats.waiting = len(self._pending)
