"""``chain.next_plan``: when the decode thread may go on to the next step by itself (no model)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from server.engine.chain import Judged, next_plan
from server.engine.scheduler import PlanEntry, RunVerdict

GOES_ON = RunVerdict(1, "x", None, False)


def slots_with(*choices: Any) -> list[Any]:
    return [SimpleNamespace(choice=c) for c in choices]


def choice(pending: int = 1, sent: int = 0, taken: int = 0, released: bool = False) -> Any:
    return SimpleNamespace(pending=[7] * pending, sent=sent, taken=taken, released=released)


def judged(*verdicts: RunVerdict | None) -> list[Judged]:
    return [Judged(SimpleNamespace(), v) for v in verdicts]  # type: ignore[arg-type]


PLAN = [PlanEntry(0, 1, False), PlanEntry(2, 1, False)]


def test_the_same_sequences_go_on_with_their_new_runs() -> None:
    slots = slots_with(choice(), None, choice(pending=3))
    assert next_plan(PLAN, judged(GOES_ON, GOES_ON), slots, channel_size=8, budget=64) == [
        PlanEntry(0, 1, False),
        PlanEntry(2, 3, False),
    ]


def test_anything_for_the_engine_task_stops_the_chain() -> None:
    ok = slots_with(choice(), None, choice())
    cases = [
        (PLAN, judged(GOES_ON, RunVerdict(1, "", "stop", True)), ok),  # a job finished
        (PLAN, judged(GOES_ON, None), ok),  # released or failed when judged
        (PLAN, judged(GOES_ON, GOES_ON), slots_with(choice(), None, choice(released=True))),
        (PLAN, judged(GOES_ON, GOES_ON), slots_with(choice(), None, None)),  # freed
        (PLAN, judged(GOES_ON, GOES_ON), slots_with(choice(), None, choice(pending=0))),
        (PLAN, judged(GOES_ON, GOES_ON), slots_with(choice(sent=7, taken=0), None, choice())),  # channel
        ([PlanEntry(0, 1, False), PlanEntry(2, 5, True)], judged(GOES_ON, GOES_ON), ok),  # a prompt chunk
        (PLAN, judged(GOES_ON), ok),  # a sequence that did not sample
    ]
    for plan, js, slots in cases:
        assert next_plan(plan, js, slots, channel_size=8, budget=64) is None


def test_room_in_the_channel_and_the_batch() -> None:
    slots = slots_with(choice(sent=6, taken=0), None, choice(pending=30))
    assert next_plan(PLAN, judged(GOES_ON, GOES_ON), slots, channel_size=8, budget=64) is not None
    assert next_plan(PLAN, judged(GOES_ON, GOES_ON), slots, channel_size=8, budget=30) is None
