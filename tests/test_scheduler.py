"""Pure scheduling logic, without a model."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.engine.scheduler import (
    PlanEntry,
    RunVerdict,
    SlotChoice,
    StopMatcher,
    Verdict,
    common_prefix,
    forced_room,
    judge_run,
    judge_token,
    pick_slot,
    plan_step,
    release_held,
)


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix((1, 2), [1, 2, 3]) == 2  # any sequence types


@given(st.lists(st.integers(0, 3), max_size=600), st.lists(st.integers(0, 3), max_size=600))
def test_common_prefix_matches_the_definition(a: list[int], b: list[int]) -> None:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix(a, b) == n
    long = list(range(1000))
    assert common_prefix(long, [*long[:700], -1]) == 700


def choose(cached: list[list[int]], last_used: list[int], prompt: list[int], saved: int = 0) -> SlotChoice:
    return pick_slot(cached, [len(c) for c in cached], last_used, prompt, saved=saved)


def test_pick_slot_prefers_longest_prefix_and_keeps_one_token_to_compute() -> None:
    choice = choose([[9, 9], [1, 2, 3, 4], [1, 2]], [5, 1, 7], [1, 2, 3, 4])
    assert choice == SlotChoice(1, 3)  # the last prompt token is recomputed for its logits


def test_pick_slot_without_match_takes_an_empty_slot_before_the_least_recently_used() -> None:
    assert choose([[5], [6], [7]], [3, 1, 2], [1, 2]) == SlotChoice(1, 0)
    assert choose([[5], [], [7], []], [1, 3, 2, 4], [1, 2]) == SlotChoice(1, 0)


def test_pick_slot_breaks_ties_by_fewer_lost_then_recency() -> None:
    assert choose([[1, 2, 3], [1, 2, 4]], [1, 2], [1, 2, 9]) == SlotChoice(1, 2)
    assert choose([[1, 2, 3, 5], [1, 2, 4]], [2, 1], [1, 2, 9]) == SlotChoice(1, 2)


def test_a_short_match_does_not_evict_a_long_cache_while_a_slot_is_empty() -> None:
    # Two prompts sharing a 3-token chat template: B must not overwrite A's cache.
    a = [1, 2, 3, *range(10, 30)]
    b = [1, 2, 3, *range(40, 60)]
    assert choose([a, [], []], [5, 0, 0], b) == SlotChoice(1, 0)
    # With every slot holding a cache, the least recently used one goes, keeping its match.
    assert choose([a, [7] * 30], [5, 2], b) == SlotChoice(1, 0)
    assert choose([a, [7] * 30], [1, 2], b) == SlotChoice(0, 3)


def test_a_match_that_keeps_as_much_as_it_throws_away_is_taken_over_an_empty_slot() -> None:
    turn1 = list(range(100))
    turn2 = [*turn1[:90], *range(500, 520)]  # 90 kept, 10 thrown away
    assert choose([[], turn1, []], [0, 1, 0], turn2) == SlotChoice(1, 90)


def test_another_scopes_cache_counts_as_held_but_never_matches() -> None:
    # Slot 0 holds another tenant's cache of the same prompt: it is neither reused nor
    # preferred over an empty slot.
    assert pick_slot([(), ()], [50, 0], [1, 2], list(range(60))) == SlotChoice(1, 0)


def test_the_host_cache_restores_into_an_empty_slot_when_it_saves_more() -> None:
    prompt = list(range(100))
    assert choose([[0, 1, 2], []], [3, 0], prompt, saved=80) == SlotChoice(1, 80, restore=True)
    # ... but not when a slot already holds at least as much.
    assert choose([prompt[:90], []], [3, 0], prompt, saved=80) == SlotChoice(0, 90)
    # Full slots: the least recently used one is evicted for the restore.
    assert choose([[7] * 50, [8] * 50], [3, 1], prompt, saved=80) == SlotChoice(1, 80, restore=True)
    # A restore never covers the last prompt token.
    assert choose([[]], [0], prompt, saved=100) == SlotChoice(0, 99, restore=True)


@given(
    st.lists(st.lists(st.integers(0, 2), max_size=12), min_size=1, max_size=5),
    st.lists(st.integers(0, 2), min_size=1, max_size=12),
    st.integers(0, 12),
)
def test_pick_slot_invariants(cached: list[list[int]], prompt: list[int], saved: int) -> None:
    last_used = list(range(len(cached)))
    choice = choose(cached, last_used, prompt, saved)
    assert 0 <= choice.index < len(cached)
    assert choice.reuse <= len(prompt) - 1
    if not choice.restore:
        assert choice.reuse <= common_prefix(cached[choice.index], prompt)
    lost = len(cached[choice.index]) - (0 if choice.restore else choice.reuse)
    if lost > 0 and any(not c for c in cached):
        # A cache is only destroyed while an empty slot is free when the match is worth it.
        assert not choice.restore and choice.reuse >= lost


def test_plan_puts_decoders_first_then_chunks_in_order() -> None:
    plan = plan_step([(0, 1), (2, 1)], [(1, 100), (3, 10)], budget=64)
    assert plan == [PlanEntry(0, 1, False), PlanEntry(2, 1, False), PlanEntry(1, 62, True)]
    plan = plan_step([], [(1, 10), (3, 10)], budget=64)
    assert plan == [PlanEntry(1, 10, True), PlanEntry(3, 10, True)]


def test_plan_respects_budget_and_empty() -> None:
    assert plan_step([], [], 64) == []
    assert len(plan_step([(i, 1) for i in range(10)], [(11, 5)], 4)) == 4


def test_plan_takes_forced_runs_whole_and_chunks_get_the_rest() -> None:
    plan = plan_step([(0, 7), (1, 1), (2, 3)], [(3, 100)], budget=16)
    assert plan == [PlanEntry(0, 7, False), PlanEntry(1, 1, False), PlanEntry(2, 3, False), PlanEntry(3, 5, True)]
    # A run that does not fit is never split: it waits for the next step; smaller ones go on.
    plan = plan_step([(0, 10), (1, 10), (2, 1)], [(3, 100)], budget=16)
    assert plan == [PlanEntry(0, 10, False), PlanEntry(2, 1, False), PlanEntry(3, 5, True)]


def test_forced_room_is_bounded_by_the_step_the_context_and_max_tokens() -> None:
    room = {"max_run": 127, "position": 10, "n_ctx_seq": 512, "n_generated": 1, "max_tokens": None}
    assert forced_room(**room) == 127  # type: ignore[arg-type]
    assert forced_room(**{**room, "position": 500}) == 11  # type: ignore[arg-type]  # last cell: position 511
    assert forced_room(**{**room, "position": 511}) == 0  # type: ignore[arg-type]
    assert forced_room(**{**room, "max_tokens": 5, "n_generated": 2}) == 3  # type: ignore[arg-type]
    assert forced_room(**{**room, "max_tokens": 5, "n_generated": 5}) == 0  # type: ignore[arg-type]
    assert forced_room(**{**room, "max_run": 0}) == 0  # type: ignore[arg-type]  # fast-forward off


def feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


@pytest.mark.parametrize(
    ("pieces", "stops", "expected", "stopped"),
    [
        (["Hello ", "wor", "ld!"], ["world"], "Hello ", True),
        (["Hel", "lo"], ["lo"], "Hel", True),
        (["abc"], ["x"], "abc", False),
        (["a", "<", "/s", "x"], ["</s>"], "a</sx", False),  # partial match released in full
        (["ab", "cd"], ["bc", "cd"], "a", True),  # earliest occurrence wins
        (["STOP"], ["STOP"], "", True),
        (["x", "y"], [], "xy", False),
    ],
)
def test_stop_matcher(pieces: list[str], stops: list[str], expected: str, stopped: bool) -> None:
    assert feed_all(StopMatcher(stops), pieces) == (expected, stopped)


def test_stop_matcher_says_which_stop_string_cut() -> None:
    m = StopMatcher(["zz", "b", "cd"])
    assert m.feed("a") == ("a", False) and m.matched is None
    assert m.feed("xcdyb") == ("x", True) and m.matched == "cd"  # the earliest occurrence
    assert StopMatcher(["b", "ab"]).feed("ab") == ("", True)
    m = StopMatcher(["b", "ab"])
    m.feed("ab")
    assert m.matched == "ab"


def test_stop_matcher_holds_back_only_possible_prefixes() -> None:
    m = StopMatcher(["###"])
    assert m.feed("abc#") == ("abc", False)
    assert m.feed("#") == ("", False)
    assert m.feed("x") == ("##x", False)


def test_stop_matcher_any_split_equals_whole_text() -> None:
    rng = random.Random(7)
    text = "The quick brown fox jumps over the lazy dog. END of story."
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert feed_all(StopMatcher(["END", "zzz"]), pieces) == ("The quick brown fox jumps over the lazy dog. ", True)
        assert feed_all(StopMatcher(["nope", "dog!"]), pieces) == (text, False)


# -- the per-token finish decision -------------------------------------------------------------


def judge(text: str, *, stops: StopMatcher | None = None, eog: bool = False, **kw: int | None) -> Verdict:
    limits: dict[str, int | None] = {"n_generated": 1, "max_tokens": None, "n_past": 10, "n_ctx_seq": 512}
    limits.update(kw)
    return judge_token(stops or StopMatcher([]), text, end_of_generation=eog, **limits)  # type: ignore[arg-type]


def test_judge_token_goes_on_while_no_limit_is_reached() -> None:
    assert judge("Hello") == Verdict("Hello", None, False)
    assert judge("x", n_generated=4, max_tokens=5, n_past=510) == Verdict("x", None, False)


def test_judge_token_end_of_generation_stops_and_releases_held_text() -> None:
    assert judge("", eog=True) == Verdict("", "stop", True)
    # An end token wins over every limit reached at the same token.
    assert judge("", eog=True, n_generated=5, max_tokens=5, n_past=512) == Verdict("", "stop", True)


def test_judge_token_stop_string_cuts_and_wins_over_limits() -> None:
    stops = StopMatcher(["END"])
    assert judge("abc E", stops=stops) == Verdict("abc ", None, False)  # "E" is held back
    assert judge("ND tail", stops=stops, n_generated=9, max_tokens=9, n_past=600) == Verdict("", "stop", False)


def test_judge_token_max_tokens_and_full_context_end_with_length() -> None:
    assert judge("a", n_generated=5, max_tokens=5) == Verdict("a", "length", True)
    assert judge("a", n_generated=6, max_tokens=5) == Verdict("a", "length", True)
    assert judge("a", n_past=512, n_ctx_seq=512) == Verdict("a", "length", True)
    assert judge("a", n_past=511, n_ctx_seq=512) == Verdict("a", None, False)


def test_judge_token_at_a_limit_keeps_a_possible_stop_prefix_for_release_held() -> None:
    stops = StopMatcher(["</s>"])
    verdict = judge("done </", stops=stops, n_generated=3, max_tokens=3)
    assert verdict == Verdict("done ", "length", True)
    # Nothing more came from the detokenizer: the held "</" is text after all.
    assert release_held(stops, "") == "</"


def test_release_held_can_complete_a_stop_string() -> None:
    stops = StopMatcher(["</s>"])
    assert judge("x </", stops=stops, n_generated=2, max_tokens=2).text == "x "
    # The detokenizer's last bytes complete the stop string: cut there, nothing after it.
    assert release_held(stops, "s> more") == ""
    assert release_held(StopMatcher([]), "tail") == "tail"


# -- a run of tokens (a sampled one and those a grammar forced after it) ------------------------

EOG = frozenset({0})
TEXTS = {1: '{"', 2: "name", 3: '":', 4: ' "', 5: "Bob", 6: '"}', 0: "<eog>"}


def run(
    tokens: list[int], *, stops: StopMatcher | None = None, **kw: int | bool | None
) -> tuple[RunVerdict, list[int]]:
    limits: dict[str, int | bool | None] = {"n_generated": 0, "max_tokens": None, "n_past": 10, "n_ctx_seq": 512}
    limits.update(kw)
    fed: list[int] = []

    def text_of(token: int) -> str:
        fed.append(token)
        return TEXTS[token]

    verdict = judge_run(stops or StopMatcher([]), tokens, text_of, eog=EOG, **limits)  # type: ignore[arg-type]
    return verdict, fed


def test_judge_run_takes_a_whole_run_that_finishes_nothing() -> None:
    assert run([1, 2, 3, 4]) == (RunVerdict(4, '{"name": "', None, False), [1, 2, 3, 4])
    assert run([5]) == (RunVerdict(1, "Bob", None, False), [5])


def test_a_stop_string_inside_a_run_ends_it_there() -> None:
    verdict, fed = run([1, 2, 3, 4, 5], stops=StopMatcher(["me"]))
    assert verdict == RunVerdict(2, '{"na', "stop", False)
    assert fed == [1, 2]  # nothing after the finishing token is detokenized


def test_max_tokens_inside_a_run_cuts_it_at_exactly_the_limit() -> None:
    verdict, fed = run([1, 2, 3, 4], n_generated=5, max_tokens=7)
    assert verdict == RunVerdict(2, '{"name', "length", True) and fed == [1, 2]
    # The context's end too: the token at the last cell is the last one kept.
    assert run([1, 2, 3, 4], n_past=510, n_ctx_seq=512)[0] == RunVerdict(3, '{"name":', "length", True)


def test_the_grammar_ends_only_with_the_last_token_of_a_run() -> None:
    assert run([4, 5, 6], grammar_done=True)[0] == RunVerdict(3, ' "Bob"}', "stop", True)
    # ...and a limit reached at that same token still reads as the grammar's end.
    assert run([4, 5, 6], grammar_done=True, n_generated=7, max_tokens=10)[0].finish == "stop"


def test_an_end_token_ends_a_run_without_text() -> None:
    assert run([5, 0, 6]) == (RunVerdict(2, "Bob", "stop", True), [5])


@given(
    st.lists(st.sampled_from(sorted(TEXTS)), min_size=1, max_size=12),
    st.lists(st.sampled_from(["me", '"B', "ob", "}", "zz", '": "']), max_size=2),
    st.integers(0, 6),
    st.one_of(st.none(), st.integers(1, 14)),
    st.integers(495, 511),
    st.booleans(),
)
def test_judge_run_equals_judging_token_by_token(
    tokens: list[int], stops: list[str], n_generated: int, max_tokens: int | None, n_past: int, grammar_done: bool
) -> None:
    limits = {"max_tokens": max_tokens, "n_ctx_seq": 512}
    verdict, _ = run(
        tokens, stops=StopMatcher(stops), n_generated=n_generated, n_past=n_past, grammar_done=grammar_done, **limits
    )
    matcher, texts = StopMatcher(stops), []
    for i, token in enumerate(tokens):
        one = judge_token(
            matcher,
            "" if token in EOG else TEXTS[token],
            end_of_generation=token in EOG,
            n_generated=n_generated + i + 1,
            n_past=n_past + i,
            grammar_done=grammar_done and i == len(tokens) - 1,
            **limits,  # type: ignore[arg-type]
        )
        texts.append(one.text)
        if one.finish is not None:
            assert verdict == RunVerdict(i + 1, "".join(texts), one.finish, one.release_held)
            return
    assert verdict == RunVerdict(len(tokens), "".join(texts), None, False)
