"""Sequences by number, in the engine with the real model: jobs pinned to a sequence, and save,
restore and erase of an idle one (``server/engine/slot_ops.py``)."""

from __future__ import annotations

import pytest
import trio

import ffi
from server.engine import Engine, EngineConfig, SlotBusy, SlotOp, SlotStateRejected, open_engine
from tests.test_engine import collect, job, settle, wait_until

CONFIG = EngineConfig(n_parallel=2, n_ctx=2048, n_batch=64, n_threads=2)
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman"


@pytest.fixture
async def engine(model: ffi.Model):
    async with open_engine(model, CONFIG) as engine:
        yield engine


def cells(engine: Engine, seq_id: int) -> int:
    return engine.context.seq_cells(seq_id)


async def test_a_pinned_job_runs_in_its_sequence(model: ffi.Model, engine: Engine) -> None:
    for seq_id in (1, 0, 1):
        prompt = f"{PROMPT} number {seq_id}"
        await collect(engine, job(model, prompt, n=3, slot=seq_id))
        view = engine.slot_ops.views()[seq_id]
        assert view.cached_tokens >= len(model.vocab.tokenize(prompt))


async def test_a_pinned_job_waits_for_its_busy_sequence(model: ffi.Model, engine: Engine) -> None:
    """The second job pinned to sequence 0 starts only once the first has finished, although
    sequence 1 is free all along."""
    events: list[str] = []

    async def run(name: str, prompt: str) -> None:
        async with engine.submit(job(model, prompt, n=12, slot=0)) as pieces:
            first = True
            async for piece in pieces:
                if first:
                    events.append(f"{name} first")
                    first = False
                if piece.finish_reason:
                    events.append(f"{name} last")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "a", PROMPT)
        await wait_until(lambda: engine.slot_ops.views()[0].busy)
        nursery.start_soon(run, "b", "A different story begins here")
    assert events == ["a first", "a last", "b first", "b last"]


async def test_save_erase_restore(model: ffi.Model, engine: Engine) -> None:
    await collect(engine, job(model, PROMPT, n=4, slot=0, cache_scope="t"))
    await settle(engine)
    saved = await engine.slot_ops.submit(SlotOp("save", 0, "t"))
    assert len(saved.tokens) == cells(engine, 0) > 0 and len(saved.data) > 0
    erased = await engine.slot_ops.submit(SlotOp("erase", 0, "t"))
    assert erased.tokens == saved.tokens and cells(engine, 0) == 0
    assert engine.slot_ops.views()[0].cached_tokens == 0
    await engine.slot_ops.submit(SlotOp("restore", 1, "t", saved.tokens, saved.data))
    assert cells(engine, 1) == len(saved.tokens)
    # The restored cells serve the same prompt in that sequence, for the same scope only.
    again = await collect(engine, job(model, PROMPT, n=2, slot=1, cache_scope="t"))
    assert again.cached_tokens == len(model.vocab.tokenize(PROMPT)) - 1


async def test_refusals(model: ffi.Model, engine: Engine) -> None:
    await collect(engine, job(model, PROMPT, n=2, slot=0, cache_scope="alice"))
    with pytest.raises(SlotBusy):
        await engine.slot_ops.submit(SlotOp("save", 0, "bob"))  # another scope's cache
    with pytest.raises(SlotStateRejected):  # the state does not hold these tokens
        await engine.slot_ops.submit(SlotOp("restore", 1, "bob", [1, 2, 3], b"\0" * 64))
    assert cells(engine, 1) == 0
    saved = await engine.slot_ops.submit(SlotOp("save", 0, "alice"))
    with pytest.raises(SlotStateRejected):
        await engine.slot_ops.submit(SlotOp("restore", 1, "alice", saved.tokens[:-1], saved.data))
    assert cells(engine, 1) == 0 and engine.slot_ops.views()[1].cached_tokens == 0
    async with engine.submit(job(model, PROMPT, n=200, slot=0, cache_scope="alice")) as pieces:
        await pieces.__anext__()
        with pytest.raises(SlotBusy):
            await engine.slot_ops.submit(SlotOp("erase", 0, "alice"))
