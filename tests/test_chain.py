"""Chained steps (``server.engine.chain``): the decode thread going on to the next step by
itself changes no answer, and stops for whatever needs the engine task: a release, a new job,
a full channel."""

from __future__ import annotations

import dataclasses

import trio

import ffi
from server.engine import EngineConfig, Pieces, open_engine
from tests.test_engine import CONFIG, PROMPTS, Result, collect, job, settle


def configs() -> tuple[EngineConfig, EngineConfig]:
    return CONFIG, dataclasses.replace(CONFIG, chain_steps=False)


async def run_mix(model: ffi.Model, config: EngineConfig) -> tuple[list[Result], int]:
    """Jobs of different lengths (one with a stop string) together, then one alone; the
    results and the steps the thread chained."""
    jobs = [job(model, p, n) for p, n in zip(PROMPTS, (40, 9, 25, 60), strict=True)]
    jobs.append(job(model, PROMPTS[0], 40, stop=[" the"]))
    results: list[Result | None] = [None] * len(jobs)
    async with open_engine(model, config) as engine:

        async def run(i: int) -> None:
            results[i] = await collect(engine, jobs[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(jobs) - 1):
                nursery.start_soon(run, i)
        await run(len(jobs) - 1)
        await settle(engine)
        assert engine.stats.active == 0 and engine.stats.kv_cells_used == engine.stats.kv_cells_cached
        return [r for r in results if r is not None], engine.stats.chained_steps


async def test_chained_steps_change_no_answer(model: ffi.Model) -> None:
    chained, off = configs()
    with_chain, n_chained = await run_mix(model, chained)
    without, n_off = await run_mix(model, off)
    assert n_chained > 0 and n_off == 0
    assert [r.tokens for r in with_chain] == [r.tokens for r in without]
    assert [r.text for r in with_chain] == [r.text for r in without]
    assert [r.finish_reason for r in with_chain] == [r.finish_reason for r in without]
    assert [r.completion_tokens for r in with_chain] == [r.completion_tokens for r in without]


async def read(pieces: Pieces, n: int) -> int:
    """Take ``n`` pieces of a running job (fewer if it ends first); how many were taken."""
    received = 0
    async for _ in pieces:
        received += 1
        if received == n:
            break
    return received


async def test_release_stops_the_chain_before_the_next_step(model: ffi.Model) -> None:
    async with open_engine(model, CONFIG) as engine:
        async with engine.submit(job(model, PROMPTS[1], 500)) as pieces:
            received = await read(pieces, 20)
            steps_at_release = engine.stats.decode_steps
        await settle(engine)
        assert engine.stats.chained_steps > 0
        # The step under way and, at most, the one the thread had just begun.
        assert engine.stats.decode_steps - steps_at_release <= 2
        assert engine.stats.generated_tokens <= received + 3
        assert engine.stats.active == 0 and engine.stats.kv_cells_used == engine.stats.kv_cells_cached
        assert engine.stats.cancellations["generate"] == 1


async def test_a_new_job_interrupts_the_chain(model: ffi.Model) -> None:
    """A job submitted while one sequence chains is prefilled within a step or two, not when the
    running job ends."""
    async with open_engine(model, CONFIG) as engine:
        async with engine.submit(job(model, PROMPTS[1], 400)) as pieces:
            assert await read(pieces, 10) == 10
            submitted_at = engine.stats.decode_steps
            async with engine.submit(job(model, PROMPTS[2], 4)) as second:
                assert await read(second, 1) == 1
                first_piece_at = engine.stats.decode_steps
            assert first_piece_at - submitted_at <= 3


async def test_a_slow_reader_pauses_a_chained_sequence(model: ffi.Model) -> None:
    """A channel of 4 pieces and a reader slower than the steps: the sequence pauses rather
    than overrun its channel, and the answer is whole."""
    config = dataclasses.replace(CONFIG, channel_size=4)
    async with open_engine(model, config) as engine:
        fast = await collect(engine, job(model, PROMPTS[3], 40))
        slow = Result()
        async with engine.submit(job(model, PROMPTS[3], 40)) as pieces:
            async for piece in pieces:
                slow.tokens += piece.tokens
                await trio.sleep(0.01)
        assert slow.tokens == fast.tokens and len(fast.tokens) == 40
        await settle(engine)
        assert engine.stats.active == 0
