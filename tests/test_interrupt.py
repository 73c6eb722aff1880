"""A decode in progress stops part-way when nothing in it is wanted any more
(``Context.interrupt``): a long prompt chunk whose client left, the engine's shutdown, an
embeddings request that ended. A step that still has a wanted job in it runs to its end.

Each long decode here is a prompt of 1800 tokens in one batch on one thread: seconds on any
CPU, so the release, 50 ms after it began, lands while it runs. The tests assert what follows from that (the step
was stopped, its cells are back, the context serves on), not how long anything took.
"""

from __future__ import annotations

import math

import trio

import ffi
from server.engine import Engine, EngineConfig, EngineError, Job, ShuttingDown, open_engine
from server.engine.embedder import open_embedder
from tests.test_engine import PROMPTS, Result, collect, settle, wait_until

CONFIG = EngineConfig(n_parallel=2, n_ctx=4096, n_batch=2048, n_threads=1)
LONG = 1800


def long_prompt(model: ffi.Model, n: int = LONG) -> list[int]:
    return model.vocab.tokenize("The lighthouse keeper wrote in his log every night. " * 200)[:n]


def endless(model: ffi.Model, n: int, prompt: str = PROMPTS[1]) -> Job:
    sampling = ffi.SamplingParams(temperature=0, logit_bias=dict.fromkeys(model.vocab.eog_tokens, -math.inf))
    return Job(model.vocab.tokenize(prompt), sampling, max_tokens=n)


async def prefilling(engine: Engine, prompt_len: int) -> None:
    """Wait until the step in the decode thread holds a prompt chunk of ``prompt_len`` tokens."""
    await wait_until(lambda: any(e.prefill and e.n_tokens == prompt_len for e in engine._chain.running))
    await trio.sleep(0.05)


async def test_a_long_prefill_whose_client_left_stops_part_way(model: ffi.Model) -> None:
    async with open_engine(model, CONFIG) as engine:
        solo = await collect(engine, endless(model, 16))
        prompt_tokens = engine.stats.prompt_tokens
        async with engine.submit(Job(long_prompt(model), ffi.SamplingParams(temperature=0), max_tokens=4)):
            await prefilling(engine, LONG)
            # left here, with its one prompt chunk in the decode
        await settle(engine)
        assert engine.stats.interrupted_steps == 1
        assert engine.stats.cancellations["prefill"] == 1
        assert engine.stats.prompt_tokens == prompt_tokens  # the long prompt never completed
        assert engine.stats.active == 0
        assert engine.stats.kv_cells_used == engine.stats.kv_cells_cached  # only idle prefix caches
        # The context decodes on as before.
        again = await collect(engine, endless(model, 16))
        assert again.tokens == solo.tokens and again.finish_reason == "length"


async def test_a_step_with_a_wanted_job_in_it_runs_to_its_end(model: ffi.Model) -> None:
    """A generating job shares the step with the long prompt chunk that is released: the step
    is not stopped, and the generating job's answer is the one it gives alone."""
    async with open_engine(model, CONFIG) as engine:
        solo = await collect(engine, endless(model, 40))
        prompt_tokens = engine.stats.prompt_tokens
        beside: Result | None = None

        async def run_beside() -> None:
            nonlocal beside
            beside = await collect(engine, endless(model, 40))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_beside)
            await wait_until(lambda: engine.stats.active == 1 and engine.stats.generated_tokens > len(solo.tokens))
            # A shorter chunk (a second or more on one thread), so that this step runs to its end soon.
            chunk = long_prompt(model, 300)
            async with engine.submit(Job(chunk, ffi.SamplingParams(temperature=0), max_tokens=4)):
                await prefilling(engine, len(chunk))
        await settle(engine)
        assert engine.stats.interrupted_steps == 0
        assert engine.stats.prompt_tokens >= prompt_tokens + len(chunk)  # its prompt chunk was decoded whole
        assert sum(engine.stats.cancellations.values()) == 1
        assert beside is not None and beside.tokens == solo.tokens
        assert engine.stats.active == 0
        assert engine.stats.kv_cells_used == engine.stats.kv_cells_cached


async def test_the_drain_deadline_stops_the_decode_in_progress(model: ffi.Model) -> None:
    """``abort_all`` (the drain's deadline) ends every job; the step they were in stops
    part-way, each job ends with the shutting-down error, and the context serves on."""
    async with open_engine(model, CONFIG) as engine:
        solo = await collect(engine, endless(model, 16))
        errors: list[EngineError] = []

        async def run_long() -> None:
            try:
                await collect(engine, Job(long_prompt(model), ffi.SamplingParams(temperature=0), max_tokens=4))
            except EngineError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_long)
            await prefilling(engine, LONG)
            engine.abort_all(ShuttingDown("server is shutting down"))
        await settle(engine)
        assert [type(e) for e in errors] == [ShuttingDown]
        assert engine.stats.interrupted_steps == 1
        assert engine.stats.active == 0
        assert engine.stats.kv_cells_used == engine.stats.kv_cells_cached
        again = await collect(engine, endless(model, 16))
        assert again.tokens == solo.tokens


async def test_an_embeddings_request_that_ends_stops_its_decode(model: ffi.Model) -> None:
    """A cancelled ``embed`` (its client gone, the drain) stops its decode in progress; the
    embedder's next answers are the ones it gave before."""
    async with open_embedder(model, n_ctx=2048, n_batch=2048, n_seq_max=2, n_threads=1, pooling=None) as embedder:
        short = model.vocab.tokenize(PROMPTS[0])
        before = await embedder.embed([short])
        with trio.move_on_after(0.3) as scope:
            await embedder.embed([long_prompt(model)])
        assert scope.cancelled_caught
        assert embedder.stats.interrupted == 1
        assert embedder.stats.ended_early == 1
        assert await embedder.embed([short]) == before
