"""The engine driver: one trio task that owns a llama.cpp context and runs continuous batching.

Public API::

    async with open_engine(model, EngineConfig(...)) as engine:
        async with engine.submit(job) as pieces:     # a sequence is ours inside this block
            async for piece in pieces:
                ...

Each turn of the loop (``Engine.run``): drop released jobs (``_reap``), give queued jobs free
sequences (``_admit``, keeping the cells of the longest cached prompt prefix), plan one batch
(``_plan``: each generating sequence's run plus prompt chunks, see
``scheduler.plan_step``), and hand it to the decode thread (``chain.run_chain``): fill +
``llama_decode`` + sampling (``step.run_step``), then judging each sequence's new tokens (the
one sampled and those a grammar forced, ``scheduler.judge_run``). Meanwhile the previous step's
pieces go out (``Outbox.hand_out``: the reader's sink when armed, ``Pieces.deliver_directly``,
else the job's bounded channel). ``_conclude`` queues each judged step's pieces. When a step
leaves nothing to decide, the thread goes on to the next one by itself while the engine task
hands the last one's pieces out (``chain``). A job whose channel is full sits out the batch
(paused) until its reader catches up. Leaving ``submit``'s block for any reason releases the
job: the engine drops it and frees its cells.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import AsyncIterator

import trio

import ffi
from server.engine import chain, scheduler, slot_ops
from server.engine.choice import Choice, Pieces, Slot
from server.engine.config import EngineConfig, EngineStats
from server.engine.decode_thread import DecodeThread
from server.engine.jobs import (
    ContextLengthExceeded,
    EngineError,
    EngineFailure,
    Job,
    Overloaded,
    Phase,
    Piece,
    ShuttingDown,
    Usage,
)
from server.engine.outbox import Outbox
from server.engine.prompt_cache import Placer

logger = logging.getLogger("llama_trio.engine")


class Engine:
    """Owns one ``ffi.Context`` with ``n_parallel`` sequences and the task that drives it.

    Create it with ``open_engine``; ``run`` is its task. All llama.cpp calls on the context
    happen in that task or in its ``DecodeThread`` while the task waits for it, never
    concurrently.
    """

    def __init__(
        self, model: ffi.Model, config: EngineConfig, thread: DecodeThread, context: ffi.Context | None = None
    ) -> None:
        """Blocking (creates the context, unless ``context``, made for ``model`` and shaped as
        ``config``, is handed over): call it in ``thread``, which the engine then owns."""
        if config.n_parallel < 1 or config.n_parallel > config.n_ctx:
            raise ValueError("n_parallel must be between 1 and n_ctx")
        if context is not None and not _shaped_for(context, model, config):
            raise ValueError("the context handed to the engine is not made for its model and its config")
        self._thread = thread
        self.model = model
        self.config = config
        self.vocab = model.vocab
        self.context = context or ffi.Context(model, **config.context_options())
        self.n_ctx_seq = self.context.n_ctx_seq
        self.n_batch = self.context.n_batch  # llama.cpp lowers n_batch to n_ctx when it is larger
        self._eog = self.vocab.eog_tokens
        self._batch = ffi.Batch(self.n_batch)
        self._slots = [Slot(i) for i in range(config.n_parallel)]
        self._queue: collections.deque[Choice] = collections.deque()
        self._wakeup = trio.Event()
        self._accepting = True
        self._tick = 0
        self.stats = EngineStats()
        self._closed = False
        self._outbox = Outbox()
        self._chain = chain.Chain(config.chain_steps, self.context)
        self._mask = ffi.TokenMask(self.vocab.n_tokens)  # scratch for constrained sampling
        self._placer = Placer(self.context, self.stats, config.cache_bytes)
        # Tokens a grammar may force into one sequence's run: every sequence's run fits a step.
        self._max_forced = self.n_batch // config.n_parallel - 1 if config.fast_forward else 0
        self.slot_ops = slot_ops.SlotOpQueue(self.context, self._slots, thread, self._wake, lambda: self._accepting)

    # -- caller side -------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def submit(self, job: Job) -> AsyncIterator[Pieces]:
        """Queue ``job``; inside the block, iterate the returned ``Pieces``.

        Raises ``ContextLengthExceeded`` when the prompt cannot fit in a sequence, ``Overloaded``
        when the queue is full, ``ShuttingDown`` when the engine no longer admits jobs.

        *Cancellation*: leaving the block for any reason (its end, an exception, a client gone)
        releases the job. A queued job is never decoded; a running one is dropped before the
        engine's next decode step, its KV cells freed and its sequence reusable.
        """
        error = self.admission_error(job)
        if error is not None:
            raise error
        choice = Choice.for_job(job, self.config.channel_size)
        self._queue.append(choice)
        self.stats.queued = len(self._queue)
        self._wake()
        try:
            yield Pieces(choice, self._wake)
        finally:
            for member in choice.members:
                member.released = True
            choice.receive.close()
            self._wake()

    def admission_error(self, job: Job) -> EngineError | None:
        """The error ``submit`` would raise for ``job`` right now, or None."""
        for prompt in job.prompts:
            if not prompt or len(prompt) >= self.n_ctx_seq:
                return ContextLengthExceeded(
                    f"the prompt is {len(prompt)} tokens; this server's context holds at most "
                    f"{self.n_ctx_seq - 1} prompt tokens per request (plus room to generate)",
                    tokens=len(prompt),
                    limit=self.n_ctx_seq,
                )
        if not 1 <= job.n_choices <= self.config.n_parallel:
            raise ValueError(f"a job's choices must number between 1 and {self.config.n_parallel}")
        if job.slot is not None and not (0 <= job.slot < self.config.n_parallel and not job.more_prompts):
            raise ValueError(f"a pinned job has one prompt, in a sequence below {self.config.n_parallel}")
        if not self._accepting:
            return ShuttingDown("server is shutting down")
        if len(self._queue) >= self.config.max_queue:
            return Overloaded("the request queue is full; retry later")
        return None

    def _wake(self) -> None:
        self._chain.attention = True
        self._wakeup.set()
        self._chain.interrupt_if_abandoned(self._slots)

    # -- shutdown hooks for the lifecycle ------------------------------------------------------

    def stop_admitting(self) -> None:
        """New ``submit`` calls raise ``ShuttingDown``; queued and running jobs continue."""
        self._accepting = False

    def fail_queued(self, error: EngineError, *, keep_streamed: bool = False) -> None:
        """End queued jobs with ``error`` now (they never decode); ``keep_streamed`` keeps streamed ones queued."""
        queued, self._queue = self._queue, collections.deque()
        for choice in queued:
            if keep_streamed and choice.job.streamed:
                self._queue.append(choice)
            else:
                choice.end_with(error)
        self.stats.queued = len(self._queue)

    def abort_all(self, error: EngineError) -> None:
        """End every queued and running job with ``error``; running ones' cells go next step."""
        self.fail_queued(error)
        for slot in self._slots:
            if slot.choice is not None:
                slot.choice.end_with(error)
        self._wake()

    @property
    def busy(self) -> bool:
        return bool(self._queue) or any(s.choice is not None for s in self._slots)

    # -- the engine task -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The engine loop; runs until cancelled. Idle (no CPU) while there is nothing to do.

        *Cancellation*: a decode step in progress is waited for (the decode thread holds the
        context and is never abandoned); then the loop ends. Running jobs get ``ShuttingDown``.
        """
        task_status.started()
        try:
            while True:
                self._chain.attention = False  # what asked for it so far is dealt with below
                self._reap()
                if self.slot_ops.pending:
                    await self.slot_ops.run_pending(meanwhile=self._outbox.hand_out)
                self._admit()
                if self._placer.pending:
                    # Saving or restoring prompt caches: C work, between decode steps.
                    await self._thread.run(self._placer.prepare, meanwhile=self._outbox.hand_out)
                    self._placer.settle()
                plan = self._plan()
                if not plan:
                    self._outbox.hand_out()
                    self._update_stats()
                    await self._wakeup.wait()
                    self._wakeup = trio.Event()
                    continue
                # The last step's pieces go out while this one decodes; then each chained step's.
                self._chain.begin(plan)
                last = await self._thread.run_posting(
                    chain.run_chain,
                    *(self.context, self._batch, self._slots, plan, self._mask, self._max_forced, self.n_ctx_seq),
                    *(self._eog, self.config.channel_size, self._chain),
                    take=self._take_posted,
                    stop=self._chain.stop,
                    meanwhile=self._outbox.hand_out,
                )
                self._chain.running = []
                if isinstance(last, chain.ChainFailed):
                    self._fail_step(last.plan, last.error)
                else:
                    self._take_steps([last])
        finally:
            # No checkpoints here: this runs to completion even while cancelled.
            self._outbox.hand_out()
            self.abort_all(ShuttingDown("server is shutting down"))
            self._reap()
            self.slot_ops.fail_all(ShuttingDown("server is shutting down"))

    def _reap(self) -> None:
        """Drop released jobs: queued ones leave the queue, running ones free their cells."""
        if any(r.released for r in self._queue):
            for choice in [r for r in self._queue if r.released]:
                self._queue.remove(choice)
                self._count_cancel(choice)
            self.stats.queued = len(self._queue)
        for slot in self._slots:
            running = slot.choice
            if running is not None and running.released:
                self._count_cancel(running)
                self._free_slot(slot, keep_cache=False)

    def _count_cancel(self, choice: Choice) -> None:
        if choice.phase is not None:
            self.stats.cancellations[choice.phase.value] += 1
            choice.phase = None

    def _free_slot(self, slot: Slot, *, keep_cache: bool) -> None:
        choice = slot.choice
        slot.choice = None
        if choice is not None and choice.sampler is not None:
            choice.sampler.close()
            choice.sampler = None
        if not keep_cache:
            self.context.seq_rm(slot.seq_id)
            slot.cached.clear()

    def _admit(self) -> None:
        free = [s for s in self._slots if s.choice is None]
        # A job pinned to a busy sequence keeps its place but holds up no one: the jobs behind
        # it take the free sequences (it can only ever take its own, and it is first in line
        # for that one). A job that wants more sequences than are free does hold the line.
        waiting: list[Choice] = []
        while self._queue and len(free) >= self._queue[0].job.n_choices:
            pinned = self._queue[0].job.slot
            if pinned is not None and self._slots[pinned] not in free:
                waiting.append(self._queue.popleft())
                continue
            choice = self._queue.popleft()
            job = choice.job
            try:
                samplers = [ffi.Sampler(job.sampling_for(m.index), self.vocab.n_tokens) for m in choice.members]
            except Exception as exc:  # one job's bad parameters must never stop the engine task
                logger.exception("cannot build a sampler; ending that job")
                choice.phase = None
                choice.end_with(EngineFailure(f"cannot build the sampler: {exc}"))
                continue
            slots: dict[Choice, Slot] = {}
            for source in (m for m in choice.members if m.source is m):
                if pinned is not None:
                    free.remove(self._slots[pinned])
                    slots[source] = self._placer.place([self._slots[pinned]], source, job.cache_scope)
                else:
                    slots[source] = self._placer.place(free, source, job.cache_scope)
            # The copies' sequences get the source's cells: the least recently used free
            # sequences give theirs up.
            free.sort(key=lambda s: s.last_used)
            for member in choice.members:
                if member.source is not member:
                    slots[member] = free.pop(0)
                    self._placer.evict(slots[member])
            for member, sampler in zip(choice.members, samplers, strict=True):
                self._tick += 1
                member.start(slots[member], sampler, self.vocab, self._tick)
            self.stats.active += len(choice.members)  # active from their first step on
        self._queue.extendleft(reversed(waiting))
        self.stats.queued = len(self._queue)

    def _plan(self) -> list[scheduler.PlanEntry]:
        decoding: list[tuple[int, int]] = []
        prefilling: list[tuple[int, int]] = []
        paused = 0
        for i, slot in enumerate(self._slots):
            choice = slot.choice
            if choice is None or choice.released:
                continue
            if choice.phase is Phase.GENERATE:
                choice.paused = choice.sent - choice.taken >= self.config.channel_size
                if choice.paused:
                    paused += 1
                elif choice.pending:
                    decoding.append((i, len(choice.pending)))
            elif choice.phase is Phase.PREFILL and choice.source is choice:  # copies wait for it
                prefilling.append((i, len(choice.prompt) - choice.n_prompt_done))
        # Prompt chunks in arrival order: the earliest-admitted slot first.
        prefilling.sort(key=lambda entry: self._slots[entry[0]].last_used)
        self.stats.paused = paused
        return scheduler.plan_step(decoding, prefilling, self.n_batch)

    def _take_posted(self, steps: list[chain.StepDone], done: bool) -> None:
        """Steps the decode thread posted as it went on to the next (chained steps): queue their
        pieces and, while the thread still runs, hand them out at once."""
        self._take_steps(steps)
        self._chain.taken += len(steps)
        self.stats.chained_steps += len(steps)
        if not done:
            self._outbox.hand_out()

    def _take_steps(self, steps: list[chain.StepDone]) -> None:
        """Count the decode thread's steps, then queue their pieces (``_conclude``)."""
        stats = self.stats
        for step in steps:
            result = step.result
            stats.decode_steps += 1
            stats.busy_slot_steps += len({entry.slot for entry in step.plan})
            stats.decode_seconds += result.decode_seconds
            if result.constrained:
                stats.constrained_tokens += result.constrained
                stats.forced_tokens += result.forced
                stats.constraint_seconds += result.constraint_seconds
            stats.last_step_seconds = step.seconds
            self._conclude(step.judged)
            if step.kv is not None:
                stats.kv_cells_used, stats.kv_cells_cached = step.kv
        self._update_stats(kv=False)

    def _conclude(self, judged: list[chain.Judged]) -> None:
        """After a step the thread judged (``chain.judge``): queue the pieces that result, and
        free the sequences of jobs that finished."""
        eog = self._eog
        for j in judged:
            out, verdict = j.out, j.verdict
            choice = out.slot.choice
            if choice is None:
                continue
            if choice.phase is Phase.PREFILL:
                choice.phase = Phase.GENERATE
                if choice.source is choice:
                    self.stats.prompt_tokens += len(choice.prompt) - choice.cached_tokens
            if choice.released:
                continue  # reaped before the next step
            if choice.failure is not None:
                choice.end_with(choice.failure)
                continue
            assert verdict is not None
            self.stats.generated_tokens += verdict.taken
            tokens = out.tokens[: verdict.taken]
            if tokens and tokens[-1] in eog:  # an end token ends the answer and is not part of it
                tokens.pop()
            piece_tokens, logprobs = choice.held + tuple(tokens), tuple(out.logprobs[: len(tokens)])
            choice.held = ()
            if verdict.finish is None:
                assert choice.pending, "a job goes on only with a run to decode"
                if j.text or logprobs:
                    self._outbox.queue(choice, Piece(j.text, piece_tokens, logprobs=logprobs, index=choice.index))
                else:  # no text yet, nor logprobs: the ids go with the next piece
                    choice.held = piece_tokens
                continue
            # A copy's prompt was its source's: a job's usage is the sum over its choices.
            prompt_tokens = len(choice.prompt) if choice.source is choice else 0
            usage = Usage(prompt_tokens, choice.n_generated, choice.cached_tokens, choice.restored_tokens)
            piece = Piece(j.text, piece_tokens, verdict.finish, usage, logprobs, choice.index, choice.stops.matched)
            self._outbox.queue(choice, piece, last=True)
            choice.phase = None
            self.stats.requests_finished += 1
            self._free_slot(out.slot, keep_cache=True)

    def _fail_step(self, plan: list[scheduler.PlanEntry], exc: ffi.DecodeError) -> None:
        if isinstance(exc, ffi.DecodeAbortedError):  # interrupted: its jobs are gone already
            self.stats.interrupted_steps += 1
        else:
            logger.error("decode failed: %s; ending the %d jobs in that step", exc, len(plan))
        for entry in plan:
            choice = self._slots[entry.slot].choice
            if choice is not None:
                choice.end_with(EngineFailure(f"decoding failed: {exc}"))

    def _update_stats(self, *, kv: bool = True) -> None:
        stats = self.stats
        stats.active = sum(1 for s in self._slots if s.choice is not None)
        stats.queued = len(self._queue)
        if kv:
            stats.kv_cells_used, stats.kv_cells_cached = slot_ops.cell_counts(self.context, self._slots)

    def close(self) -> None:
        """Free the context, batch and samplers. Idempotent; call only after ``run`` ended."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:
            if slot.choice is not None and slot.choice.sampler is not None:
                slot.choice.sampler.close()
            slot.choice = None
        self._placer.close()
        self._batch.close()
        self.context.close()
        self._thread.close()


def _shaped_for(context: ffi.Context, model: ffi.Model, config: EngineConfig) -> bool:
    """Whether ``context`` was made for ``model`` with ``config.context_options()``."""
    options = config.context_options()
    attention = options.pop("attention")
    p = context.params
    made = {name: getattr(p, name) for name in options}
    made["kv_unified"] = bool(made["kv_unified"])
    return context.model is model and context.attention == attention and made == options


@contextlib.asynccontextmanager
async def open_engine(
    model: ffi.Model, config: EngineConfig, *, context: ffi.Context | None = None
) -> AsyncIterator[Engine]:
    """Create an engine (on ``context`` when one is handed over: the engine owns it from now),
    run its task in a nursery, and close it when the block ends.

    *Cancellation*: leaving the block cancels the engine task, waits for any decode step in
    progress, ends remaining jobs with ``ShuttingDown``, then frees the context.
    """
    thread = DecodeThread()
    try:
        engine = await thread.run(Engine, model, config, thread, context)
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
