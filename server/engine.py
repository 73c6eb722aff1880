"""The engine: one trio task that owns a llama.cpp context and runs continuous batching.

Public API::

    async with open_engine(model, EngineConfig(...)) as engine:
        async with engine.submit(job) as stream:     # a sequence is ours inside this block
            async for piece in stream:
                ...

Each decode step, the engine task admits queued jobs into free sequences (keeping the cells of
the longest cached prompt prefix), builds one batch (one token per decoding sequence plus
prompt chunks, see ``scheduler.plan_step``), runs decode + sampling in its own decode thread, and
delivers one ``Piece`` per sequence while the next step decodes: to the reader's sink when one
is armed (``Stream.deliver_directly``), otherwise into that job's bounded channel with
``send_nowait``. A job whose channel is full is skipped (paused) until its reader catches up. Leaving ``submit``'s
block for any reason releases the job: the engine drops it before its next step and frees its
KV cells.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import queue
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

import ffi
from server import scheduler

logger = logging.getLogger(__name__)


# -- jobs, pieces and errors ----------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """What to generate: prompt tokens, how to sample, when to stop."""

    prompt: Sequence[int]
    sampling: ffi.SamplingParams = field(default_factory=ffi.SamplingParams)
    max_tokens: int | None = None  # None: until end of generation or the sequence's context ends
    stop: Sequence[str] = ()
    logprobs: bool = False  # reserved for a later feature; accepted, not yet produced


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Piece:
    """A delivery to a stream: new text and the tokens behind it. The last piece of a job has
    ``finish_reason`` ("stop" or "length") and ``usage``; the others have neither."""

    text: str
    tokens: tuple[int, ...]
    finish_reason: str | None = None
    usage: Usage | None = None


class EngineError(Exception):
    """Base for errors a job can end with. ``code`` is the OpenAI-style error code."""

    code = "engine_error"
    status = 500


class Overloaded(EngineError):
    """The queue is full; retry later."""

    code = "overloaded"
    status = 503


class ShuttingDown(EngineError):
    """The server is draining or stopping: the job was refused, dropped from the queue, or cut."""

    code = "server_shutting_down"
    status = 503


class ContextLengthExceeded(EngineError):
    """The prompt does not fit in one sequence's context."""

    code = "context_length_exceeded"
    status = 400


class EngineFailure(EngineError):
    """llama.cpp failed to decode a step that included this job."""

    code = "engine_failure"
    status = 500


class Phase(enum.Enum):
    QUEUED = "queued"
    PREFILL = "prefill"
    GENERATE = "generate"


# -- configuration and statistics ------------------------------------------------------------


@dataclass(frozen=True)
class EngineConfig:
    n_parallel: int = 4
    n_ctx: int = 8192  # KV cells in all; each sequence has its own n_ctx // n_parallel
    n_batch: int = 512  # tokens per decode step, decoding tokens and prompt chunks together
    n_threads: int = 2
    max_queue: int = 64
    # Pieces buffered per job before its sequence pauses; a reader this far behind is slow.
    channel_size: int = 32


# While the engine is busy, the KV cell counts in ``EngineStats`` are refreshed every this many
# decode steps; they are exact whenever the engine is idle.
KV_STATS_EVERY = 8


@dataclass
class EngineStats:
    queued: int = 0
    active: int = 0
    paused: int = 0
    kv_cells_used: int = 0  # all cells in use, as llama.cpp reports them
    kv_cells_cached: int = 0  # of those, held by idle sequences for prefix reuse
    prompt_tokens: int = 0  # processed (not counting cached ones)
    cached_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0  # inside llama_decode, all steps together
    last_step_seconds: float = 0.0
    requests_finished: int = 0
    cancellations: dict[str, int] = field(default_factory=lambda: {p.value: 0 for p in Phase})


# -- one request in the engine ---------------------------------------------------------------


class _Request:
    __slots__ = (
        "job",
        "send",
        "receive",
        "phase",
        "released",
        "slot",
        "sampler",
        "detok",
        "stops",
        "n_past",
        "n_prompt_done",
        "n_generated",
        "cached_tokens",
        "pending",
        "paused",
        "sent",
        "taken",
        "sink",
    )

    def __init__(self, job: Job, channel_size: int) -> None:
        self.job = job
        self.send, self.receive = trio.open_memory_channel[Piece | EngineError](channel_size)
        self.phase: Phase | None = Phase.QUEUED  # None once finished or counted as cancelled
        self.released = False
        self.slot: _Slot | None = None
        self.sampler: ffi.Sampler | None = None
        self.detok: ffi.Detokenizer | None = None
        self.stops = scheduler.StopMatcher(job.stop)
        self.n_past = 0  # tokens of this sequence in KV
        self.n_prompt_done = 0
        self.n_generated = 0
        self.cached_tokens = 0
        self.pending: int | None = None  # sampled token to decode next step
        self.paused = False
        # Items put into / taken out of the channel; their difference is what it buffers (cheaper
        # than asking the channel for its statistics every step).
        self.sent = 0
        self.taken = 0
        # Set by ``Stream.deliver_directly``: takes pieces in place of the channel while armed.
        self.sink: Callable[[Piece], bool] | None = None


class _Slot:
    __slots__ = ("seq_id", "cached", "request", "last_used")

    def __init__(self, seq_id: int) -> None:
        self.seq_id = seq_id
        self.cached: list[int] = []  # tokens whose KV cells this sequence holds, in order
        self.request: _Request | None = None
        self.last_used = 0


# -- the stream a caller reads ---------------------------------------------------------------


class Stream:
    """Pieces of one job, in order. Iterating raises the ``EngineError`` the job ended with.

    *Cancellation*: cancelling a task blocked in iteration is safe; the job keeps its sequence
    until ``submit``'s block is left, which releases it.
    """

    def __init__(self, engine: Engine, request: _Request) -> None:
        self._engine = engine
        self._request = request

    def __aiter__(self) -> Stream:
        return self

    def deliver_directly(self, sink: Callable[[Piece], bool]) -> None:
        """Arm ``sink`` for the pieces that come next, when the channel is empty (otherwise do
        nothing: iterate first).

        While armed, the engine task calls ``sink(piece)`` with each piece in place of putting
        it in the channel, synchronously, between decode steps. It must not block or reach a
        checkpoint; it returns True when it has taken the piece (written it out), False to
        refuse it. A refused piece, and every one after it, goes through the channel until the
        next ``deliver_directly``; an exception counts as a refusal (and is logged). Errors
        always come through the channel.

        Arm only with nothing of this stream's in flight (every piece taken from the channel
        already written), so that a piece the sink takes can never overtake one taken by
        iteration. Cancellation does not apply (synchronous).
        """
        request = self._request
        if request.sent == request.taken:
            request.sink = sink

    async def __anext__(self) -> Piece:
        request = self._request
        try:
            item = await request.receive.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        request.taken += 1
        if request.paused:
            self._engine._wake()
        if isinstance(item, EngineError):
            raise item
        return item


# -- the decode thread -----------------------------------------------------------------------


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
    """

    def __init__(self, name: str = "llama-trio-decode") -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._done_recv, self._done_send = socket.socketpair()
        self._done_recv.setblocking(False)
        self._result: tuple[bool, Any] | None = None
        self._busy = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, args = call
            try:
                self._result = (True, fn(*args))
            except BaseException as exc:  # handed to the caller, raised there
                self._result = (False, exc)
            self._done_send.send(b"\0")

    async def run(self, fn: Callable[..., Any], *args: Any, meanwhile: Callable[[], None] | None = None) -> Any:
        """``fn(*args)`` in the thread; ``meanwhile()``, when given, runs here (synchronously)
        once the call is handed over, while it runs."""
        if self._busy:
            raise RuntimeError("DecodeThread.run is not reentrant")
        await trio.lowlevel.checkpoint_if_cancelled()
        self._busy = True
        self._calls.put((fn, args))
        try:
            try:
                if meanwhile is not None:
                    meanwhile()
                await trio.lowlevel.wait_readable(self._done_recv)
            except BaseException:  # cancelled: the call goes on; wait for it, then re-raise
                with trio.CancelScope(shield=True):
                    await trio.lowlevel.wait_readable(self._done_recv)
                raise
            finally:
                with contextlib.suppress(BlockingIOError):
                    self._done_recv.recv(1)
        finally:
            self._busy = False
        assert self._result is not None
        (ok, value), self._result = self._result, None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        if self._thread.is_alive():
            self._calls.put(None)
            self._thread.join()
        self._done_recv.close()
        self._done_send.close()


# -- the engine ------------------------------------------------------------------------------


class Engine:
    """Owns one ``ffi.Context`` with ``n_parallel`` sequences and the task that drives it.

    Create it with ``open_engine``; ``run`` is its task. All llama.cpp calls on the context
    happen in that task or in its ``DecodeThread`` while the task waits for it, never
    concurrently.
    """

    def __init__(self, model: ffi.Model, config: EngineConfig, thread: DecodeThread) -> None:
        """Blocking (creates the context): call it in ``thread``, which the engine then owns."""
        if config.n_parallel < 1 or config.n_parallel > config.n_ctx:
            raise ValueError("n_parallel must be between 1 and n_ctx")
        self._thread = thread
        self.model = model
        self.config = config
        self.vocab = model.vocab
        self.context = ffi.Context(
            model,
            n_ctx=config.n_ctx,
            n_batch=config.n_batch,
            n_seq_max=config.n_parallel,
            n_threads=config.n_threads,
            # One KV stream per sequence: a sequence's cells sit at the same places whatever
            # runs beside it, so greedy output does not depend on the other streams (with a
            # unified buffer, attention sums run in a layout-dependent order and can differ).
            kv_unified=False,
        )
        self.n_ctx_seq = self.context.n_ctx_seq
        self._eog = self.vocab.eog_tokens
        self._batch = ffi.Batch(config.n_batch)
        self._slots = [_Slot(i) for i in range(config.n_parallel)]
        self._queue: collections.deque[_Request] = collections.deque()
        self._wakeup = trio.Event()
        self._accepting = True
        self._tick = 0
        self.stats = EngineStats()
        self._closed = False
        self._decode_seconds = 0.0  # of the last step; written by the decode thread
        self._outbox: list[tuple[_Request, Piece, bool]] = []  # pieces for ``_flush``

    # -- caller side -------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def submit(self, job: Job) -> AsyncIterator[Stream]:
        """Queue ``job``; inside the block, iterate the returned ``Stream`` for its pieces.

        Raises ``ContextLengthExceeded`` when the prompt cannot fit in a sequence, ``Overloaded``
        when the queue is full, ``ShuttingDown`` when the engine no longer admits jobs.

        *Cancellation*: leaving the block for any reason — normal end, exception, or
        cancellation (a client that went away) — releases the job. A queued job is never
        decoded; a running one is dropped before the engine's next decode step, its KV cells
        freed and its sequence reusable.
        """
        error = self.admission_error(job)
        if error is not None:
            raise error
        request = _Request(job, self.config.channel_size)
        self._queue.append(request)
        self.stats.queued = len(self._queue)
        self._wake()
        try:
            yield Stream(self, request)
        finally:
            request.released = True
            request.receive.close()
            self._wake()

    def admission_error(self, job: Job) -> EngineError | None:
        """The error ``submit`` would raise for ``job`` right now, or None."""
        if not job.prompt or len(job.prompt) >= self.n_ctx_seq:
            return ContextLengthExceeded(
                f"the prompt is {len(job.prompt)} tokens; this server's context holds at most "
                f"{self.n_ctx_seq - 1} prompt tokens per request (plus room to generate)"
            )
        if not self._accepting:
            return ShuttingDown("server is shutting down")
        if len(self._queue) >= self.config.max_queue:
            return Overloaded("the request queue is full; retry later")
        return None

    def _wake(self) -> None:
        self._wakeup.set()

    # -- shutdown hooks for the lifecycle ------------------------------------------------------

    def stop_admitting(self) -> None:
        """New ``submit`` calls raise ``ShuttingDown``; queued and running jobs continue."""
        self._accepting = False

    def fail_queued(self, error: EngineError) -> None:
        """End every queued job with ``error`` now (they never decode)."""
        while self._queue:
            request = self._queue.popleft()
            self._end_with_error(request, error)
        self.stats.queued = 0

    def abort_all(self, error: EngineError) -> None:
        """End every queued and running job with ``error``; running jobs' cells are freed at
        the engine's next step."""
        self.fail_queued(error)
        for slot in self._slots:
            if slot.request is not None:
                self._end_with_error(slot.request, error)
        self._wake()

    @property
    def busy(self) -> bool:
        return bool(self._queue) or any(s.request is not None for s in self._slots)

    # -- the engine task -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The engine loop; runs until cancelled. Idle (no CPU) while there is nothing to do.

        *Cancellation*: a decode step in progress is waited for (the decode thread holds the
        context and is never abandoned); then the loop ends. Jobs still running get
        ``ShuttingDown``.
        """
        task_status.started()
        try:
            while True:
                self._reap()
                self._admit()
                plan = self._plan()
                if not plan:
                    self._flush()
                    self._update_stats()
                    await self._wakeup.wait()
                    self._wakeup = trio.Event()
                    continue
                started = time.perf_counter()
                try:
                    # What the last step produced goes out while this one decodes.
                    sampled = await self._thread.run(self._step, plan, meanwhile=self._flush)
                except ffi.DecodeError as exc:
                    self._fail_step(plan, exc)
                    continue
                self.stats.decode_steps += 1
                self.stats.decode_seconds += self._decode_seconds
                self.stats.last_step_seconds = time.perf_counter() - started
                self._deliver(sampled)
                # KV counts take two C calls per sequence: every few steps while busy, and
                # always when the engine goes idle (above).
                self._update_stats(kv=self.stats.decode_steps % KV_STATS_EVERY == 0)
        finally:
            # No checkpoints here: this runs to completion even while cancelled.
            self._flush()
            self.abort_all(ShuttingDown("server is shutting down"))
            self._reap()

    def _reap(self) -> None:
        """Drop released jobs: queued ones leave the queue, running ones free their cells."""
        if any(r.released for r in self._queue):
            for request in [r for r in self._queue if r.released]:
                self._queue.remove(request)
                self._count_cancel(request)
            self.stats.queued = len(self._queue)
        for slot in self._slots:
            running = slot.request
            if running is not None and running.released:
                self._count_cancel(running)
                self._free_slot(slot, keep_cache=False)

    def _count_cancel(self, request: _Request) -> None:
        if request.phase is not None:
            self.stats.cancellations[request.phase.value] += 1
            request.phase = None

    def _free_slot(self, slot: _Slot, *, keep_cache: bool) -> None:
        request = slot.request
        slot.request = None
        if request is not None and request.sampler is not None:
            request.sampler.close()
            request.sampler = None
        if not keep_cache:
            self.context.seq_rm(slot.seq_id)
            slot.cached.clear()

    def _admit(self) -> None:
        free = [s for s in self._slots if s.request is None]
        while free and self._queue:
            request = self._queue.popleft()
            try:
                sampler = ffi.Sampler(request.job.sampling, self.vocab.n_tokens)
            except Exception as exc:  # one job's bad parameters must never stop the engine task
                logger.exception("cannot build a sampler; ending that job")
                request.phase = None
                self._end_with_error(request, EngineFailure(f"cannot build the sampler: {exc}"))
                continue
            prompt = request.job.prompt
            choice = scheduler.pick_slot([s.cached for s in free], [s.last_used for s in free], prompt)
            slot = free.pop(choice.index)
            reuse = choice.reuse
            if reuse < len(slot.cached) and not self.context.seq_rm(slot.seq_id, reuse, -1):
                self.context.seq_rm(slot.seq_id)
                reuse = 0
            del slot.cached[reuse:]
            self._tick += 1
            slot.last_used = self._tick
            slot.request = request
            request.slot = slot
            request.phase = Phase.PREFILL
            request.n_past = reuse
            request.n_prompt_done = reuse
            request.cached_tokens = reuse
            request.sampler = sampler
            request.detok = ffi.Detokenizer(self.vocab)
            self.stats.cached_tokens += reuse
        self.stats.queued = len(self._queue)

    def _plan(self) -> list[scheduler.PlanEntry]:
        decoding: list[int] = []
        prefilling: list[tuple[int, int]] = []
        paused = 0
        for i, slot in enumerate(self._slots):
            request = slot.request
            if request is None or request.released:
                continue
            if request.phase is Phase.GENERATE:
                request.paused = request.sent - request.taken >= self.config.channel_size
                if request.paused:
                    paused += 1
                elif request.pending is not None:
                    decoding.append(i)
            elif request.phase is Phase.PREFILL:
                prefilling.append((i, len(request.job.prompt) - request.n_prompt_done))
        # Prompt chunks in arrival order: the earliest-admitted slot first.
        prefilling.sort(key=lambda entry: self._slots[entry[0]].last_used)
        self.stats.paused = paused
        return scheduler.plan_step(decoding, prefilling, self.config.n_batch)

    def _step(self, plan: list[scheduler.PlanEntry]) -> list[tuple[_Slot, int]]:
        """Worker thread: fill the batch, decode, sample. Touches only what the loop is not
        touching while it waits for this thread."""
        batch = self._batch
        batch.clear()
        to_sample: list[tuple[_Slot, int]] = []
        for entry in plan:
            slot = self._slots[entry.slot]
            request = slot.request
            assert request is not None
            if entry.prefill:
                start = request.n_prompt_done
                chunk = request.job.prompt[start : start + entry.n_tokens]
                last = start + entry.n_tokens == len(request.job.prompt)
                index = batch.add_run(chunk, request.n_past, slot.seq_id, logits_last=last)
                if last:
                    to_sample.append((slot, index))
            else:
                assert request.pending is not None
                index = batch.add(request.pending, request.n_past, slot.seq_id, logits=True)
                to_sample.append((slot, index))
        started = time.perf_counter()
        self.context.decode(batch)
        self._decode_seconds = time.perf_counter() - started
        # Bookkeeping of what is now in KV, then sampling.
        for entry in plan:
            slot = self._slots[entry.slot]
            request = slot.request
            assert request is not None
            if entry.prefill:
                start = request.n_prompt_done
                slot.cached.extend(request.job.prompt[start : start + entry.n_tokens])
                request.n_prompt_done += entry.n_tokens
                request.n_past += entry.n_tokens
            else:
                slot.cached.append(request.pending)  # type: ignore[arg-type]
                request.n_past += 1
                request.pending = None
        out: list[tuple[_Slot, int]] = []
        for slot, index in to_sample:
            request = slot.request
            assert request is not None and request.sampler is not None
            out.append((slot, request.sampler.sample(self.context, index)))
        return out

    def _deliver(self, sampled: list[tuple[_Slot, int]]) -> None:
        eog = self._eog
        for slot, token in sampled:
            request = slot.request
            if request is None:
                continue
            if request.phase is Phase.PREFILL:
                request.phase = Phase.GENERATE
                self.stats.prompt_tokens += len(request.job.prompt) - request.cached_tokens
            if request.released:
                continue  # reaped before the next step
            request.n_generated += 1
            self.stats.generated_tokens += 1
            detok = request.detok
            assert detok is not None
            finish: str | None = None
            stopped = False
            tokens: tuple[int, ...]
            if token in eog:
                text, tokens, finish = "", (), "stop"
            else:
                tokens = (token,)
                text, stopped = request.stops.feed(detok.feed(token))
                if stopped:
                    finish = "stop"
                elif request.job.max_tokens is not None and request.n_generated >= request.job.max_tokens:
                    finish = "length"
                elif request.n_past >= self.n_ctx_seq:
                    finish = "length"  # the sequence's context is full
            if finish is None:
                request.pending = token
                if text:
                    self._send(request, Piece(text, tokens))
                continue
            if not stopped:  # release what the detokenizer and the stop matcher still hold
                tail, stopped = request.stops.feed(detok.flush())
                text += tail if stopped else tail + request.stops.flush()
            usage = Usage(len(request.job.prompt), request.n_generated, request.cached_tokens)
            self._send(request, Piece(text, tokens, finish, usage), last=True)
            request.phase = None
            self.stats.requests_finished += 1
            self._free_slot(slot, keep_cache=True)

    def _send(self, request: _Request, piece: Piece, *, last: bool = False) -> None:
        """Queue ``piece`` for ``_flush``; its room in the channel is held from now on."""
        request.sent += 1
        self._outbox.append((request, piece, last))

    def _flush(self) -> None:
        """Hand out the queued pieces: through each stream's sink or channel."""
        outbox, self._outbox = self._outbox, []
        for request, piece, last in outbox:
            request.sent -= 1
            self._deliver_one(request, piece)
            if last:
                request.send.close()

    def _deliver_one(self, request: _Request, item: Piece) -> None:
        sink = request.sink
        if sink is not None:
            try:
                if sink(item):
                    return
            except Exception:  # a reader's bug must never stop the engine task
                logger.exception("direct delivery failed; the stream goes on through its channel")
            request.sink = None
        try:
            request.send.send_nowait(item)
            request.sent += 1
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            request.released = True  # the reader is gone
        except trio.WouldBlock:  # pragma: no cover - _plan never schedules a full channel
            logger.error("delivery to a full channel; dropping the job")
            request.released = True

    def _end_with_error(self, request: _Request, error: EngineError) -> None:
        if request.send.statistics().current_buffer_used >= request.send.statistics().max_buffer_size:
            # Make room: the error matters more than text the reader has not taken yet.
            with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError, trio.EndOfChannel):
                request.receive.receive_nowait()
        with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            request.send.send_nowait(error)
        request.send.close()
        request.released = True

    def _fail_step(self, plan: list[scheduler.PlanEntry], exc: ffi.DecodeError) -> None:
        logger.error("decode failed: %s; ending the %d jobs in that step", exc, len(plan))
        for entry in plan:
            request = self._slots[entry.slot].request
            if request is not None:
                self._end_with_error(request, EngineFailure(f"decoding failed: {exc}"))

    def _update_stats(self, *, kv: bool = True) -> None:
        stats = self.stats
        stats.active = sum(1 for s in self._slots if s.request is not None)
        stats.queued = len(self._queue)
        if not kv:
            return
        used = cached = 0
        for slot in self._slots:
            cells = self.context.seq_cells(slot.seq_id)
            used += cells
            if slot.request is None:
                cached += cells
        stats.kv_cells_used = used
        stats.kv_cells_cached = cached

    def close(self) -> None:
        """Free the context, batch and samplers. Idempotent; call only after ``run`` ended."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:
            if slot.request is not None and slot.request.sampler is not None:
                slot.request.sampler.close()
            slot.request = None
        self._batch.close()
        self.context.close()
        self._thread.close()


@contextlib.asynccontextmanager
async def open_engine(model: ffi.Model, config: EngineConfig) -> AsyncIterator[Engine]:
    """Create an engine, run its task in a nursery, and close it when the block ends.

    *Cancellation*: leaving the block cancels the engine task, waits for any decode step in
    progress, ends remaining jobs with ``ShuttingDown``, then frees the context.
    """
    thread = DecodeThread()
    try:
        engine = await thread.run(Engine, model, config, thread)
    except BaseException:
        thread.close()
        raise
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            try:
                yield engine
            finally:
                nursery.cancel_scope.cancel()
    finally:
        engine.close()
