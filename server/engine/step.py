"""One decode step, as the decode thread runs it: fill the batch from the plan, run
``llama_decode``, record what each sequence's KV cells now hold, and sample every sequence
that produced logits.

It touches only the slots and choices in the plan, which the engine task leaves alone while
it waits for the decode thread (``Engine.run``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import ffi
from server.engine.choice import Slot
from server.engine.grammar import GrammarError
from server.engine.jobs import ConstraintFailed, TokenLogprob
from server.engine.scheduler import PlanEntry


@dataclass(frozen=True, slots=True)
class StepResult:
    sampled: list[tuple[Slot, int]]  # (slot, token) for every sequence that produced logits
    decode_seconds: float  # inside llama_decode
    constrained: int  # tokens sampled under a grammar
    constraint_seconds: float  # computing and applying their masks, and advancing the grammars


def run_step(
    context: ffi.Context, batch: ffi.Batch, slots: Sequence[Slot], plan: Sequence[PlanEntry], mask: ffi.TokenMask
) -> StepResult:
    """Blocking: call it in the decode thread. Raises ``ffi.DecodeError`` when llama.cpp
    cannot decode the batch (nothing is then recorded as decoded). A sequence with a grammar
    samples under its mask (``mask`` is scratch memory) and feeds the token to its grammar; a
    grammar that fails sets the choice's ``failure``."""
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
            assert choice.pending is not None
            index = batch.add(choice.pending, choice.n_past, slot.seq_id, logits=True)
            to_sample.append((slot, index))
    started = time.perf_counter()
    context.decode(batch)
    decode_seconds = time.perf_counter() - started
    # Bookkeeping of what is now in KV, then sampling.
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
            slot.cached.append(choice.pending)  # type: ignore[arg-type]
            choice.n_past += 1
            choice.pending = None
    for source_slot, index in forks:
        # The prompt's other choices start from copies of its cells (llama.cpp copies between
        # KV streams only whole sequences) and sample from the same logits row.
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
    out, constrained, constraint_seconds = _sample(context, to_sample, mask)
    return StepResult(out, decode_seconds, constrained, constraint_seconds)


def _sample(
    context: ffi.Context, to_sample: list[tuple[Slot, int]], mask: ffi.TokenMask
) -> tuple[list[tuple[Slot, int]], int, float]:
    """Sample each slot's next token from its logits row (under its grammar's mask, feeding the
    token to the grammar); the tokens, how many were constrained, and the grammar work's seconds."""
    out: list[tuple[Slot, int]] = []
    constrained = 0
    constraint_seconds = 0.0
    for slot, index in to_sample:
        choice = slot.choice
        assert choice is not None and choice.sampler is not None
        matcher = choice.matcher
        wanted = choice.job.logprobs
        if matcher is None:
            token = choice.sampler.sample(context, index)
            if wanted is not None:
                choice.logprob = TokenLogprob(token, *_logprobs(context, index, token, wanted))
            out.append((slot, token))
            continue
        started = time.perf_counter()
        matcher.fill_mask(mask)
        token = choice.sampler.sample(context, index, mask)
        if wanted is not None:  # the row is masked now: the grammar's distribution
            choice.logprob = TokenLogprob(token, *_logprobs(context, index, token, wanted))
        try:
            matcher.consume(token)
        except GrammarError as exc:
            choice.failure = ConstraintFailed(f"the output's grammar cannot go on: {exc}")
        constraint_seconds += time.perf_counter() - started
        constrained += 1
        out.append((slot, token))
    return out, constrained, constraint_seconds


def _logprobs(context: ffi.Context, index: int, token: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    chosen, top = context.logprobs(index, token, k)
    return chosen, tuple(top)
