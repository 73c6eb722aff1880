"""Decode steps chained in the decode thread: when a step leaves nothing for the engine task to
decide, the thread judges it and goes straight on to the next one.

At one step per token, the engine task would otherwise sit between every two steps: the thread
wakes it, it judges the tokens and plans the next step, and wakes the thread again. On a model
whose step is short (a small model, a GPU) those two wake-ups are a tenth of a token's time.
So the thread judges each step's tokens itself (``judge``: the detokenizer, stop strings,
``max_tokens``, the end of the context; it owns those while it runs). A step it goes on from
it posts (``StepDone``) to the engine task, which queues and hands out the pieces while the
thread decodes the next step; the step it stops after comes back as the call's result (one
wake-up of the engine task, as without chaining). The thread chains a next step only when the engine task would
have planned exactly it (``next_plan``):

- the step was all decoding (no prompt chunk: a job that starts needs the engine task);
- every sequence in it goes on: none finished, failed, was released or has a full channel;
- nothing asked for the engine task's attention since it handed the step over (``Chain``: a
  new job, a job released, a reader catching up, a slot operation, shutdown all call the
  engine's ``_wake``, which sets it);
- the engine task has taken every earlier step's outcome (the thread runs at most one step
  ahead of it, so a starved event loop stops the chain rather than piling up pieces).

So a released job is decoded in no step that begins after its release is seen, as before; and
a step in progress none of whose jobs is wanted any more stops part-way
(``Chain.interrupt_if_abandoned``: a long prompt chunk of a client that left, the drain's
deadline).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

import ffi
from server.engine import scheduler, slot_ops
from server.engine.choice import Choice, Slot
from server.engine.config import KV_STATS_EVERY
from server.engine.scheduler import PlanEntry
from server.engine.step import Sampled, StepResult, run_step


class Chain:
    """What the engine task and the decode thread share about chaining; plain attributes, each
    written by one side while a step runs (the engine task zeroes the counts between calls)."""

    __slots__ = ("enabled", "attention", "posted", "taken", "steps", "running", "_context")

    def __init__(self, enabled: bool, context: ffi.Context) -> None:
        self.enabled = enabled
        self._context = context
        self.attention = False  # engine side: something needs the engine task; stop chaining
        self.posted = 0  # thread side: steps posted
        self.taken = 0  # engine side: steps taken
        self.steps = 0  # thread side: steps run, for the KV statistics' cadence
        self.running: list[PlanEntry] = []  # engine side: the plan handed to the thread, while it runs

    def begin(self, plan: list[PlanEntry]) -> None:
        """Engine side, as ``plan`` goes to the thread: zero the counts; decodes may run."""
        self.taken = self.posted = 0
        self.running = plan
        self._context.resume()

    def stop(self) -> None:
        """The engine task is cancelled: no more chained steps, and the decode in progress
        stops part-way (every job ends with the engine)."""
        self.attention = True
        self._context.interrupt()

    def interrupt_if_abandoned(self, slots: Sequence[Slot]) -> None:
        """Stop the decode in progress part-way when no job in its step is wanted any more
        (clients gone, or the drain's deadline ended them): its work would be thrown away.
        Those jobs' sequences are freed whole, so the KV cells the interrupted decode leaves
        behind go with them (the step comes back as ``ChainFailed``)."""
        if self.running and all((c := slots[e.slot].choice) is None or c.released for e in self.running):
            self._context.interrupt()


@dataclass(slots=True)
class Judged:
    """One sequence's tokens of a step, judged (``verdict`` is None for a choice that was gone,
    released or failed: the engine task deals with those); ``text`` includes what the
    detokenizer held when the answer ends for a reason other than a stop string."""

    out: Sampled
    verdict: scheduler.RunVerdict | None
    text: str = ""


@dataclass(slots=True)
class StepDone:
    """One step's outcome, posted to the engine task."""

    result: StepResult
    judged: list[Judged]
    plan: list[PlanEntry]
    seconds: float  # the step's time in the thread: fill, decode, sampling and judging
    kv: tuple[int, int] | None  # ``slot_ops.cell_counts`` now and then, else None


@dataclass(frozen=True, slots=True)
class ChainFailed:
    """What ``run_chain`` returns when llama.cpp could not decode a step: that step's plan and the error."""

    plan: list[PlanEntry]
    error: ffi.DecodeError


def judge(sampled: Sequence[Sampled], eog: Container[int], n_ctx_seq: int) -> list[Judged]:
    """In the thread: what each sequence's new tokens do to its answer (``scheduler.judge_run``);
    counts them in ``Choice.n_generated``."""
    judged = []
    for out in sampled:
        choice = out.slot.choice
        if choice is None or choice.released or choice.failure is not None:
            judged.append(Judged(out, None))
            continue
        detok = choice.detok
        assert detok is not None
        verdict = scheduler.judge_run(
            choice.stops,
            out.tokens,
            detok.feed,
            eog=eog,
            n_generated=choice.n_generated,
            max_tokens=choice.job.max_tokens,
            n_past=out.position,
            n_ctx_seq=n_ctx_seq,
            grammar_done=out.grammar_done,
        )
        choice.n_generated += verdict.taken
        text = verdict.text
        if verdict.finish is not None and verdict.release_held:
            text += scheduler.release_held(choice.stops, detok.flush())
        judged.append(Judged(out, verdict, text))
    return judged


def next_plan(
    plan: Sequence[PlanEntry], judged: Sequence[Judged], slots: Sequence[Slot], *, channel_size: int, budget: int
) -> list[PlanEntry] | None:
    """The step the engine task would plan after this one, when it is the same sequences
    decoding on (see the module's conditions), else None. Pure but for reading the choices."""
    if len(judged) != len(plan) or any(entry.prefill for entry in plan):
        return None
    entries = []
    for entry, j in zip(plan, judged, strict=True):
        choice: Choice | None = slots[entry.slot].choice
        if choice is None or j.verdict is None or j.verdict.finish is not None or choice.released:
            return None
        # Room for this step's piece, not yet queued, and the next one's.
        if not choice.pending or choice.sent - choice.taken + 2 > channel_size:
            return None
        entries.append(PlanEntry(entry.slot, len(choice.pending), False))
    if sum(entry.n_tokens for entry in entries) > budget:
        return None
    return entries


def run_chain(
    context: ffi.Context,
    batch: ffi.Batch,
    slots: Sequence[Slot],
    plan: list[PlanEntry],
    mask: ffi.TokenMask,
    max_forced: int,
    n_ctx_seq: int,
    eog: Container[int],
    channel_size: int,
    chain: Chain,
    post: Callable[[StepDone], None],
) -> StepDone | ChainFailed:
    """Blocking: the decode thread's part. Run ``plan``'s step and judge it; while
    ``next_plan`` allows and ``chain`` has seen no call for attention, post it and run the next
    one. Returns the last step (its outcome goes back with the call's end: one wake-up of the
    engine task, not two), or the step llama.cpp could not decode."""
    while True:
        started = time.perf_counter()
        try:
            result = run_step(context, batch, slots, plan, mask, max_forced, n_ctx_seq)
        except ffi.DecodeError as exc:
            return ChainFailed(plan, exc)
        judged = judge(result.sampled, eog, n_ctx_seq)
        chain.steps += 1
        kv = slot_ops.cell_counts(context, slots) if chain.steps % KV_STATS_EVERY == 0 else None
        done = StepDone(result, judged, plan, time.perf_counter() - started, kv)
        # The engine task has taken every step posted before: the thread runs one step ahead at most.
        if not chain.enabled or chain.attention or chain.posted > chain.taken:
            return done
        following = next_plan(plan, judged, slots, channel_size=channel_size, budget=batch.capacity)
        if following is None:
            return done
        post(done)
        chain.posted += 1
        plan = following
