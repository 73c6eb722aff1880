"""The engine's vocabulary: what a caller submits (``Job``), what it gets back (``Piece``, with
``Usage`` on the last one), the errors a job can end with, and ``PieceSink``, the contract of a
reader that takes pieces straight from the engine task. Plain data; no IO, no llama.cpp calls.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import ffi

if TYPE_CHECKING:
    from server.engine.grammar import Grammar


@dataclass(frozen=True)
class Job:
    """What to generate: prompt tokens, how to sample, when to stop."""

    prompt: Sequence[int]
    sampling: ffi.SamplingParams = field(default_factory=ffi.SamplingParams)
    max_tokens: int | None = None  # None: until end of generation or the sequence's context ends
    stop: Sequence[str] = ()
    # Prefix reuse stays within a scope: a job reuses cached prompt tokens only from jobs with
    # the same ``cache_scope`` (a tenant, a salt), so no one learns another scope's prompts.
    cache_scope: str = ""
    # Constrained decoding: every token is one the grammar allows, and the grammar reaching its
    # end finishes the job ("stop"). None: unconstrained (and no cost).
    grammar: Grammar | None = None
    # Log-probabilities of each generated token and of this many likeliest alternatives (0-20);
    # None: none computed (and no cost).
    logprobs: int | None = None
    # Choices: the prompt is computed once and its KV cells copied to n sequences, which then
    # decode independently (a seed gives choice i the seed + i). Pieces carry their ``index``.
    n: int = 1
    # More prompts answered in the same job (a batch of completions), n choices each: choice
    # index = prompt's place * n + its number.
    more_prompts: tuple[Sequence[int], ...] = ()
    # The caller hands pieces on as they come, and its answer began before the job was queued
    # (an SSE stream's head and first chunk): ending it unstarted is an error its client sees,
    # which no proxy can retry, so a drain leaves it queued (``Engine.fail_queued``).
    streamed: bool = False
    # The sequence the job's prompt runs in (llama-server's ``id_slot``), whose cache it then
    # reuses; it waits for that one, and jobs queued after it wait behind it. With ``n`` > 1 the
    # other choices take other sequences, as ever. None: the best free one. One prompt only.
    slot: int | None = None

    @property
    def prompts(self) -> tuple[Sequence[int], ...]:
        return (self.prompt, *self.more_prompts)

    @property
    def n_choices(self) -> int:
        return self.n * (1 + len(self.more_prompts))

    def sampling_for(self, index: int) -> ffi.SamplingParams:
        """Choice ``index``'s sampling: the job's seed + index, so that choices differ and each
        is reproducible (no seed: each draws its own)."""
        if index == 0 or self.sampling.seed is None:
            return self.sampling
        return dataclasses.replace(self.sampling, seed=self.sampling.seed + index)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    restored_tokens: int = 0  # of the cached ones, restored from the host-memory prompt cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability under the model's distribution at that step (before
    logit_bias, penalties, temperature and the top-k/top-p/min-p filters; under a grammar,
    among the tokens it allowed), and the likeliest tokens there with theirs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Piece:
    """A delivery to a reader: new text and the tokens behind it (with their log-probabilities
    when the job asked). The last piece of each choice has ``finish_reason`` ("stop" or
    "length") and ``usage`` (its own completion tokens), and ``stop_sequence`` when one of the
    job's stop strings ended it; the others have none of these."""

    text: str
    tokens: tuple[int, ...]
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    index: int = 0  # the choice, for a job with n > 1
    stop_sequence: str | None = None


@dataclass(frozen=True)
class SequenceView:
    """What one sequence is doing, for an operator (llama-server's ``/slots``): counts only,
    never the tokens (they may be another tenant's prompt)."""

    seq_id: int
    busy: bool
    cached_tokens: int  # tokens whose KV cells it holds
    prompt_tokens: int = 0  # of the job it runs (0 when idle)
    generated_tokens: int = 0
    phase: Phase | None = None


class PieceSink(Protocol):
    """Takes a job's pieces in place of its channel while armed (``Pieces.deliver_directly``).

    The engine task calls it synchronously, between decode steps, with each piece in order.
    It must not block, reach a checkpoint or take long: every other sequence waits meanwhile.
    It returns True when it has taken the piece (written it out), False to refuse it; a refused
    piece, and every piece after it, goes through the channel until the reader arms a sink
    again. An exception counts as a refusal (the engine logs it). Errors never go to a sink.
    """

    def __call__(self, piece: Piece, /) -> bool: ...


class Phase(enum.Enum):
    """Where a job is: waiting for a sequence, computing its prompt, or generating."""

    QUEUED = "queued"
    PREFILL = "prefill"
    GENERATE = "generate"


class EngineError(Exception):
    """Base for errors a job can end with. ``code`` is the OpenAI-style error code, ``status``
    the HTTP status an API would answer with."""

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
    """The prompt does not fit in one sequence's context: ``tokens`` against ``limit`` (a
    sequence's context, which must also hold at least one generated token)."""

    code = "context_length_exceeded"
    status = 400

    def __init__(self, message: str, *, tokens: int = 0, limit: int = 0) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.limit = limit


class ConstraintFailed(EngineError):
    """The job's grammar could not go on (a resource limit of its grammar engine)."""

    code = "constraint_failed"
    status = 400


class EngineFailure(EngineError):
    """llama.cpp failed to decode a step that included this job."""

    code = "engine_failure"
    status = 500
