"""One decode step, as the decode thread runs it: fill the batch from the plan, run
``llama_decode``, record what each sequence's KV cells now hold, and sample every sequence
that produced logits.

A constrained sequence then asks its grammar for the tokens it forces next (fast-forward): the
text allows one continuation only, so they need no sampling and go into the next decode with
the sampled token, as a prompt chunk does; that decode's last row gives the next free token.
Forced tokens are judged with the sampled one, in this step (``Sampled.tokens``), except when
the job wants log-probabilities: those come from the rows of the decode that appends the run
(each under the grammar's mask at its place, as a sampled token's), so the run is judged after
that decode, ahead of the token sampled there.

It touches only the slots and choices in the plan, which the engine task leaves alone while
it waits for the decode thread (``Engine.run``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import ffi
from server.engine import scheduler
from server.engine.choice import Choice, Slot
from server.engine.grammar import GrammarError
from server.engine.jobs import ConstraintFailed, TokenLogprob
from server.engine.scheduler import PlanEntry


@dataclass(slots=True)
class Sampled:
    """What one sequence's step gives its answer: ``tokens`` in order (sampled, or forced by a
    grammar), the first at ``position`` in the sequence, with their log-probabilities when the
    job asks."""

    slot: Slot
    tokens: list[int]
    position: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    grammar_done: bool = False  # the grammar ended with the last of ``tokens``


@dataclass(frozen=True, slots=True)
class StepResult:
    sampled: list[Sampled]  # for every sequence that produced logits
    decode_seconds: float  # inside llama_decode
    constrained: int  # tokens sampled under a grammar
    forced: int  # tokens a grammar forced (fast-forwarded, not sampled)
    constraint_seconds: float  # masks, grammar steps and forced runs


def run_step(
    context: ffi.Context,
    batch: ffi.Batch,
    slots: Sequence[Slot],
    plan: Sequence[PlanEntry],
    mask: ffi.TokenMask,
    max_forced: int,
    n_ctx_seq: int,
) -> StepResult:
    """Blocking: call it in the decode thread. Raises ``ffi.DecodeError`` when llama.cpp
    cannot decode the batch (nothing is then recorded as decoded). A sequence with a grammar
    samples under its mask (``mask`` is scratch memory), feeds the token to its grammar, and
    takes up to ``max_forced`` forced tokens after it (0: none); a grammar that fails sets the
    choice's ``failure``."""
    batch.clear()
    to_sample: list[tuple[Slot, int]] = []
    forks: list[tuple[Slot, int]] = []  # prompts that complete now and have copies to make
    for entry in plan:
        slot = slots[entry.slot]
        choice = slot.choice
        assert choice is not None
        if entry.prefill:
            start = choice.n_prompt_done
            chunk = choice.prompt[start : start + entry.n_tokens]
            last = start + entry.n_tokens == len(choice.prompt)
            index = batch.add_run(chunk, choice.n_past, slot.seq_id, logits_last=last)
            if last:
                to_sample.append((slot, index))
                if choice.copies:
                    forks.append((slot, index))
        else:
            run = choice.pending
            if len(run) == 1:
                index = batch.add(run[0], choice.n_past, slot.seq_id, logits=True)
            elif choice.unjudged:  # the forced tokens' log-probabilities: every row
                for i, token in enumerate(run):
                    index = batch.add(token, choice.n_past + i, slot.seq_id, logits=True)
            else:
                index = batch.add_run(run, choice.n_past, slot.seq_id, logits_last=True)
            to_sample.append((slot, index))
    started = time.perf_counter()
    context.decode(batch)
    decode_seconds = time.perf_counter() - started
    # Bookkeeping of what is now in KV, then sampling (which replaces ``pending``).
    for entry in plan:
        slot = slots[entry.slot]
        choice = slot.choice
        assert choice is not None
        if entry.prefill:
            start = choice.n_prompt_done
            slot.cached.extend(choice.prompt[start : start + entry.n_tokens])
            choice.n_prompt_done += entry.n_tokens
            choice.n_past += entry.n_tokens
        else:
            slot.cached.extend(choice.pending)
            choice.n_past += len(choice.pending)
    _fork(context, forks, to_sample)
    out: list[Sampled] = []
    constrained = forced = 0
    constraint_seconds = 0.0
    for slot, index in to_sample:
        choice = slot.choice
        assert choice is not None and choice.sampler is not None
        wanted = choice.job.logprobs
        if choice.matcher is None:
            token = choice.sampler.sample(context, index)
            choice.pending = [token]
            sampled = Sampled(slot, [token], choice.n_past)
            if wanted is not None:
                sampled.logprobs.append(TokenLogprob(token, *_logprobs(context, index, token, wanted)))
            out.append(sampled)
            continue
        started = time.perf_counter()
        sampled, n_forced = _sample_constrained(context, slot, choice, index, mask, max_forced, n_ctx_seq)
        constraint_seconds += time.perf_counter() - started
        if n_forced >= 0:
            constrained += 1
            forced += n_forced
        out.append(sampled)
    return StepResult(out, decode_seconds, constrained, forced, constraint_seconds)


def _fork(context: ffi.Context, forks: list[tuple[Slot, int]], to_sample: list[tuple[Slot, int]]) -> None:
    """A completed prompt's other choices start from copies of its cells (llama.cpp copies
    between KV streams only whole sequences) and sample from the same logits row."""
    for source_slot, index in forks:
        source = source_slot.choice
        assert source is not None
        for member in source.copies:
            copy = member.slot
            assert copy is not None
            context.seq_rm(copy.seq_id)
            context.seq_cp(source_slot.seq_id, copy.seq_id)
            copy.cached = list(source_slot.cached)
            member.n_past, member.n_prompt_done = source.n_past, source.n_prompt_done
            to_sample.append((copy, index))


def _sample_constrained(
    context: ffi.Context, slot: Slot, choice: Choice, index: int, mask: ffi.TokenMask, max_forced: int, n_ctx_seq: int
) -> tuple[Sampled, int]:
    """Judge a forced run left for now (``choice.unjudged``), sample under the grammar's mask at
    batch ``index``, and take the run the grammar forces next. Returns the output and the
    length of that run (-1: nothing was sampled)."""
    matcher, sampler, wanted = choice.matcher, choice.sampler, choice.job.logprobs
    assert matcher is not None and sampler is not None
    n_left = choice.unjudged
    left = choice.pending[len(choice.pending) - n_left :] if n_left else []
    sampled = Sampled(slot, [], choice.n_past - n_left)
    choice.pending, choice.unjudged = [], 0
    try:
        for i, token in enumerate(left):  # (only for a job that wants log-probabilities)
            matcher.fill_mask(mask)
            row = index - n_left + i  # the row of the token before it
            sampled.logprobs.append(TokenLogprob(token, *_logprobs(context, row, token, wanted or 0, mask)))
            matcher.consume(token)
            sampler.accept(token)
            sampled.tokens.append(token)
        if left and matcher.done:  # the run ended the grammar: nothing to sample
            sampled.grammar_done = True
            return sampled, -1
        matcher.fill_mask(mask)
        token = sampler.sample(context, index, mask)
        if wanted is not None:  # the row is masked now: the grammar's distribution
            sampled.logprobs.append(TokenLogprob(token, *_logprobs(context, index, token, wanted)))
        matcher.consume(token)
        sampled.tokens.append(token)
        room = scheduler.forced_room(
            max_run=max_forced,
            position=choice.n_past,
            n_ctx_seq=n_ctx_seq,
            n_generated=choice.n_generated + len(sampled.tokens),
            max_tokens=choice.job.max_tokens,
        )
        run = matcher.forced(room) if room and not matcher.done else []
        if run and wanted is None:
            matcher.consume_run(run)
            for forced in run:
                sampler.accept(forced)  # (penalties count them as generated)
            sampled.tokens += run
        elif run:
            choice.unjudged = len(run)
        choice.pending = [token, *run]
        sampled.grammar_done = matcher.done
        return sampled, len(run)
    except GrammarError as exc:
        choice.failure = ConstraintFailed(f"the output's grammar cannot go on: {exc}")
        return sampled, 0


def _logprobs(
    context: ffi.Context, index: int, token: int, k: int, mask: ffi.TokenMask | None = None
) -> tuple[float, tuple[tuple[int, float], ...]]:
    chosen, top = context.logprobs(index, token, k, mask)
    return chosen, tuple(top)
