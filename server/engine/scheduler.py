"""Pure scheduling logic for the engine: no IO, no llama.cpp, testable on its own.

- ``common_prefix`` / ``pick_slot``: which free sequence to give a new job: the one that saves
  the most prompt work without throwing away more cached work than it saves.
- ``plan_step``: what one decode step carries — every decoding sequence's run (the token it
  sampled, and the tokens its grammar forced after it), then prompt chunks of prefilling
  sequences in arrival order, within the batch budget.
- ``forced_room``: how many forced tokens may follow a sampled one into the next decode.
- ``StopMatcher``: stop strings that may span token boundaries, holding back text that could
  still turn out to be the start of one.
- ``judge_token`` / ``judge_run`` / ``release_held``: what one token, or a run of them, does to
  its job: the text released, and whether (and at which token) the job finishes (end token,
  stop string, grammar's end, ``max_tokens``, context full).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import NamedTuple


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    # Slices compare only between sequences of one type; the engine's are lists already.
    a = a if isinstance(a, list) else list(a)
    b = b if isinstance(b, list) else list(b)
    n = min(len(a), len(b))
    i = 0
    # Whole blocks compare at C speed; only the block with the first difference goes token by token.
    while i + _BLOCK <= n and a[i : i + _BLOCK] == b[i : i + _BLOCK]:
        i += _BLOCK
    while i < n and a[i] == b[i]:
        i += 1
    return i


_BLOCK = 128


@dataclass(frozen=True)
class SlotChoice:
    index: int  # position in the candidates given to ``pick_slot``
    reuse: int  # prompt tokens whose KV cells are kept (or restored)
    restore: bool = False  # the reused tokens come from the host cache, not from the slot


def pick_slot(
    cached: Sequence[Sequence[int]],
    held: Sequence[int],
    last_used: Sequence[int],
    prompt: Sequence[int],
    *,
    saved: int = 0,
) -> SlotChoice:
    """Choose among free slots for ``prompt``, by what the choice saves and what it destroys.

    ``cached[i]`` are the tokens slot ``i`` holds that this job may reuse (empty for another
    scope's cache), ``held[i]`` how many cells it holds in all, ``last_used[i]`` its last-use
    tick; ``saved`` is the longest prefix of the prompt the host cache could restore.

    1. A slot whose cache matches the prompt for at least as many tokens as it would throw
       away: the longest match wins (ties: fewer thrown away, then the most recent).
    2. Else, when the host cache restores more than any slot's match, it restores into the
       slot chosen as in 3.
    3. Else an empty slot; else the least recently used one (its cache is the least likely to
       be wanted again), keeping whatever prefix it matches.

    So a short match never evicts a long cache while an empty slot is free. At least the last
    prompt token is always computed, because its logits are needed to sample.
    """
    if not cached:
        raise ValueError("no free slot")
    limit = max(len(prompt) - 1, 0)
    match = [min(common_prefix(tokens, prompt), limit) for tokens in cached]
    keeps = [i for i in range(len(cached)) if match[i] > 0 and match[i] >= held[i] - match[i]]
    best = max(keeps, key=lambda i: (match[i], -held[i], last_used[i]), default=None)
    saved = min(saved, limit)
    if best is not None and match[best] >= saved:
        return SlotChoice(best, match[best])
    empty = [i for i in range(len(cached)) if held[i] == 0]
    pool = empty or range(len(cached))
    victim = min(pool, key=lambda i: last_used[i])
    if saved > match[victim]:
        return SlotChoice(victim, saved, restore=True)
    return SlotChoice(victim, match[victim])


@dataclass(frozen=True)
class PlanEntry:
    slot: int
    n_tokens: int  # a decoding slot's run (1 + forced tokens); a chunk length for a prefilling one
    prefill: bool


def plan_step(
    decoding: Sequence[tuple[int, int]], prefilling: Sequence[tuple[int, int]], budget: int
) -> list[PlanEntry]:
    """Plan one batch of at most ``budget`` tokens.

    ``decoding`` lists (slot, run length) of slots whose last sampled token, and the tokens a
    grammar forced after it, are to be appended; ``prefilling`` lists (slot, prompt tokens
    still to process) in arrival order. Decoding slots go first so that a long prompt never
    stalls running streams; the rest of the budget goes to prompt chunks, oldest first. A run
    is never split (its last token's logits are the ones to sample); one that does not fit
    waits for the next step (the engine bounds runs so that all of them fit).
    """
    plan = []
    left = budget
    for slot, n in decoding:
        if n <= left:
            plan.append(PlanEntry(slot, n, False))
            left -= n
    for slot, remaining in prefilling:
        if left <= 0:
            break
        n = min(remaining, left)
        if n > 0:
            plan.append(PlanEntry(slot, n, True))
            left -= n
    return plan


def forced_room(*, max_run: int, position: int, n_ctx_seq: int, n_generated: int, max_tokens: int | None) -> int:
    """How many tokens a grammar may force after a sampled token, to be decoded with it in one
    run: at most ``max_run`` (a sequence's share of a step), none past the sequence's context
    (``position`` is the sampled token's place there) and none past ``max_tokens``
    (``n_generated`` counts the answer's tokens up to the sampled one). A run cut here loses
    nothing: the next token is then sampled under the grammar, which allows only that text."""
    room = min(max_run, n_ctx_seq - 1 - position)
    if max_tokens is not None:
        room = min(room, max_tokens - n_generated)
    return max(room, 0)


class StopMatcher:
    """Cuts generated text at the first stop string; never emits a stop string or text after it.

    ``feed(text)`` returns ``(safe_text, stopped)``: text that can no longer be part of a stop
    string is released; a suffix that might begin one is held until the next piece decides.
    ``flush()`` releases what is held when generation ends for another reason. ``matched`` is
    the stop string that cut the text, once one has.
    """

    __slots__ = ("_stops", "_held", "_longest", "matched")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self._longest = max((len(s) for s in self._stops), default=0)
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        if not self._stops:
            return text, False
        buf = self._held + text
        cut = -1
        for stop in self._stops:
            i = buf.find(stop)
            if i >= 0 and (cut < 0 or i < cut):
                cut, self.matched = i, stop
        if cut >= 0:
            self._held = ""
            return buf[:cut], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(stop.startswith(tail) for stop in self._stops):
                return k
        return 0

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class Verdict(NamedTuple):
    """What one sampled token does to its job."""

    text: str  # text released now
    finish: str | None  # "stop" or "length" when the job ends with this token, else None
    # The job ends for a reason other than a stop string: the text the detokenizer still holds
    # (an incomplete UTF-8 sequence) is released too, through ``release_held``.
    release_held: bool


def judge_token(
    stops: StopMatcher,
    text: str,
    *,
    end_of_generation: bool,
    n_generated: int,
    max_tokens: int | None,
    n_past: int,
    n_ctx_seq: int,
    grammar_done: bool = False,
) -> Verdict:
    """Decide one sampled token: ``text`` is what the detokenizer gave for it ("" for an
    end-of-generation token, which is never detokenized), ``n_generated`` counts it, ``n_past``
    is the sequence's length in KV without it.

    In order: an end-of-generation token ends the job ("stop", no text of its own); a stop string
    completed by this text ends it ("stop", text cut before the stop string); the job's grammar
    reaching its end with this token ends it ("stop", the token's text kept); then
    ``max_tokens`` reached and a full context end it ("length").
    """
    if end_of_generation:
        return Verdict("", "stop", True)
    released, stopped = stops.feed(text)
    if stopped:
        return Verdict(released, "stop", False)
    if grammar_done:
        return Verdict(released, "stop", True)
    if (max_tokens is not None and n_generated >= max_tokens) or n_past >= n_ctx_seq:
        return Verdict(released, "length", True)
    return Verdict(released, None, False)


class RunVerdict(NamedTuple):
    """What a run of tokens does to its job."""

    taken: int  # tokens of the run in the answer: all of them, or up to the one that finishes it
    text: str  # text released
    finish: str | None
    release_held: bool  # as in ``Verdict``


def judge_run(
    stops: StopMatcher,
    tokens: Sequence[int],
    text_of: Callable[[int], str],
    *,
    eog: Container[int],
    n_generated: int,
    max_tokens: int | None,
    n_past: int,
    n_ctx_seq: int,
    grammar_done: bool = False,
) -> RunVerdict:
    """Judge ``tokens`` in order, each as ``judge_token`` would one by one, up to the first that
    finishes the job: a stop string, ``max_tokens`` or the context's end inside a run (a token
    sampled and those a grammar forced after it) cuts it exactly where the same tokens would
    have ended the job one step at a time.

    ``text_of(token)`` gives a token's text (the detokenizer: called once for each token up to
    the finishing one, never for an end-of-generation token or past the finish);
    ``n_generated`` counts the answer's tokens before the run, ``n_past`` is the first token's
    position in the sequence; ``grammar_done``: the grammar ended with the run's last token.
    """
    texts = []
    last = len(tokens) - 1
    for i, token in enumerate(tokens):
        end = token in eog
        verdict = judge_token(
            stops,
            "" if end else text_of(token),
            end_of_generation=end,
            n_generated=n_generated + i + 1,
            max_tokens=max_tokens,
            n_past=n_past + i,
            n_ctx_seq=n_ctx_seq,
            grammar_done=grammar_done and i == last,
        )
        texts.append(verdict.text)
        if verdict.finish is not None:
            return RunVerdict(i + 1, "".join(texts), verdict.finish, verdict.release_held)
    return RunVerdict(len(tokens), "".join(texts), None, False)


def release_held(stops: StopMatcher, held: str) -> str:
    """At a finish that was not a stop string: the text the detokenizer still held, passed
    through the stop matcher (it may complete a stop string), then whatever the matcher held."""
    text, stopped = stops.feed(held)
    return text if stopped else text + stops.flush()
