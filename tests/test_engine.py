"""The engine with the real model: batching, cancellation, backpressure, stops, prefix reuse.

Jobs that must run to their ``max_tokens`` (to be cancelled mid-way, to keep a sequence busy,
to end with ``length``) ban the model's end-of-generation tokens (``endless``): what the greedy
choice is differs between CPUs where two tokens nearly tie, and an end token could be one.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field

import pytest
import trio

import ffi
from server.engine import ContextLengthExceeded, Engine, EngineConfig, Job, Overloaded, Piece, open_engine

GREEDY = ffi.SamplingParams(temperature=0)
PROMPTS = [
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The capital of France is",
]


def endless(model: ffi.Model) -> ffi.SamplingParams:
    """Greedy, with every end-of-generation token banned: the job runs to its limit."""
    return ffi.SamplingParams(temperature=0, logit_bias=dict.fromkeys(model.vocab.eog_tokens, -math.inf))


@dataclass
class Result:
    text: str = ""
    texts: list[str] = field(default_factory=list)  # each piece's
    tokens: list[int] = field(default_factory=list)
    pieces: int = 0
    finish_reason: str | None = None
    cached_tokens: int = 0
    completion_tokens: int = 0


async def collect(engine: Engine, job: Job) -> Result:
    result = Result()
    async with engine.submit(job) as pieces:
        async for piece in pieces:
            result.text += piece.text
            result.texts.append(piece.text)
            result.tokens += piece.tokens
            result.pieces += 1
            if piece.finish_reason:
                result.finish_reason = piece.finish_reason
                assert piece.usage is not None
                result.cached_tokens = piece.usage.cached_tokens
                result.completion_tokens = piece.usage.completion_tokens
    return result


def job(model: ffi.Model, prompt: str, n: int = 24, **kw: object) -> Job:
    """A greedy job that generates ``n`` tokens (but for a stop string)."""
    return Job(prompt=model.vocab.tokenize(prompt), sampling=endless(model), max_tokens=n, **kw)  # type: ignore[arg-type]


async def wait_until(predicate, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.005)


async def settle(engine: Engine) -> None:
    """Wait until the engine has nothing to do and its statistics are current."""
    await wait_until(lambda: not engine.busy)
    await trio.sleep(0.05)
    engine._wake()
    await trio.sleep(0.05)


CONFIG = EngineConfig(n_parallel=4, n_ctx=4096, n_batch=64, n_threads=2)


@pytest.fixture
async def engine(model: ffi.Model):
    async with open_engine(model, CONFIG) as engine:
        yield engine


async def test_concurrent_greedy_equals_sequential(model: ffi.Model, engine: Engine) -> None:
    jobs = [job(model, p, 32) for p in PROMPTS]
    sequential = [await collect(engine, j) for j in jobs]
    concurrent: list[Result | None] = [None] * len(jobs)

    async def run(i: int) -> None:
        concurrent[i] = await collect(engine, jobs[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(jobs)):
            nursery.start_soon(run, i)
    assert [r.tokens for r in concurrent] == [r.tokens for r in sequential]  # type: ignore[union-attr]
    assert all(r.finish_reason == "length" and len(r.tokens) == 32 for r in sequential)


async def test_cancel_mid_generation_frees_everything(model: ffi.Model, engine: Engine) -> None:
    undisturbed = job(model, PROMPTS[0], 48)
    solo = await collect(engine, undisturbed)
    steps_at_cancel = 0
    beside: Result | None = None

    async def run_beside() -> None:
        nonlocal beside
        beside = await collect(engine, undisturbed)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_beside)
        async with engine.submit(job(model, PROMPTS[1], 500)) as pieces:
            received = 0
            async for _ in pieces:
                received += 1
                if received == 5:
                    break
            steps_at_cancel = engine.stats.decode_steps
    await settle(engine)
    assert beside is not None and beside.tokens == solo.tokens
    assert engine.stats.active == 0
    assert engine.stats.kv_cells_used == engine.stats.kv_cells_cached  # only idle prefix caches
    assert engine.stats.cancellations["generate"] == 1
    # The cancelled job did not keep decoding: it generated about as many tokens as it was read.
    assert engine.stats.generated_tokens <= 2 * 48 + 5 + 2
    assert engine.stats.decode_steps - steps_at_cancel <= 48 + 1


async def test_cancel_during_prefill(model: ffi.Model, engine: Engine) -> None:
    long_prompt = model.vocab.tokenize("word " * 700)[:600]  # 10 chunks of 64
    undisturbed = job(model, PROMPTS[2], 24)
    solo = await collect(engine, undisturbed)
    beside: Result | None = None

    async def run_beside() -> None:
        nonlocal beside
        beside = await collect(engine, undisturbed)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_beside)
        with trio.move_on_after(30):
            async with engine.submit(Job(long_prompt, GREEDY, max_tokens=4)):
                start = engine.stats.decode_steps
                await wait_until(lambda: engine.stats.decode_steps >= start + 3)
                # cancelled here, mid-prefill
    prompt_tokens_before = engine.stats.prompt_tokens
    await settle(engine)
    assert beside is not None and beside.tokens == solo.tokens
    assert engine.stats.cancellations["prefill"] == 1
    assert engine.stats.active == 0
    assert engine.stats.kv_cells_used == engine.stats.kv_cells_cached
    assert engine.stats.prompt_tokens == prompt_tokens_before  # the long prompt never completed


async def test_cancel_while_queued_never_decodes(model: ffi.Model) -> None:
    async with open_engine(model, EngineConfig(n_parallel=1, n_ctx=1024, n_batch=64, n_threads=2)) as engine:
        running = job(model, PROMPTS[0], 16)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect, engine, running)
            await wait_until(lambda: engine.stats.active == 1)
            with trio.move_on_after(0.05):
                async with engine.submit(job(model, PROMPTS[1], 16)):
                    assert engine.stats.queued == 1
                    await trio.sleep_forever()
        await settle(engine)
        steps = engine.stats.decode_steps
        assert engine.stats.cancellations["queued"] == 1
        assert engine.stats.prompt_tokens == len(running.prompt)  # only the running job's prompt
        assert engine.stats.generated_tokens == 16
        await trio.sleep(0.2)
        assert engine.stats.decode_steps == steps
        assert engine.stats.active == 0 and engine.stats.queued == 0


async def test_queue_full_is_overloaded(model: ffi.Model) -> None:
    config = EngineConfig(n_parallel=1, n_ctx=1024, n_batch=64, n_threads=2, max_queue=1)
    async with open_engine(model, config) as engine:
        async with engine.submit(job(model, PROMPTS[0], 200)):
            await wait_until(lambda: engine.stats.active == 1)
            async with engine.submit(job(model, PROMPTS[1], 8)):
                with pytest.raises(Overloaded):
                    async with engine.submit(job(model, PROMPTS[2], 8)):
                        pass  # pragma: no cover


async def test_long_prompt_interleaves_with_running_stream(model: ffi.Model, engine: Engine) -> None:
    long_prompt = model.vocab.tokenize("word " * 700)[: CONFIG.n_batch * 8]
    events: list[str] = []

    async def runner() -> None:
        async with engine.submit(job(model, PROMPTS[0], 200)) as pieces:
            async for _ in pieces:
                events.append("run")

    async def long_job() -> None:
        async with engine.submit(Job(long_prompt, GREEDY, max_tokens=2)) as pieces:
            events.append("submit-long")
            async for _ in pieces:
                events.append("long")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner)
        await wait_until(lambda: events.count("run") >= 3)
        nursery.start_soon(long_job)
    first_long = events.index("long")
    submitted = events.index("submit-long")
    # The running stream kept receiving tokens while the 8 chunks of the long prompt ran.
    assert events[submitted:first_long].count("run") >= 6


FAST_TOKENS = 200


async def test_slow_consumer_does_not_slow_a_fast_one(model: ffi.Model, engine: Engine) -> None:
    """A reader that stops reading holds back only its own sequence: once its channel is full
    the sequence is paused, and a fast job beside it runs to its end meanwhile. Were the engine
    held back by the slow reader, the fast job would wait for it for ever (the time limit fails
    it); no step of it depends on how fast the machine is."""
    slow_read = 0
    fast_done = trio.Event()
    paused_at_fast_end = 0

    async def slow() -> None:
        nonlocal slow_read
        async with engine.submit(job(model, PROMPTS[1], 1000)) as pieces:
            async for _ in pieces:
                slow_read += 1
                if slow_read == 3:
                    await fast_done.wait()  # reads nothing more until the fast job is done
                elif slow_read > 3:
                    break

    async def fast() -> None:
        nonlocal paused_at_fast_end
        result = await collect(engine, job(model, "Count: 1, 2, 3, 4,", FAST_TOKENS))
        assert len(result.tokens) == FAST_TOKENS
        paused_at_fast_end = engine.stats.paused
        fast_done.set()

    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow)
            nursery.start_soon(fast)
    assert slow_read == 4  # three pieces before the fast job ended, one after
    assert paused_at_fast_end == 1  # the slow reader's sequence, its channel full


async def test_direct_delivery_keeps_order_through_refusals(
    model: ffi.Model, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream read partly through a direct sink and partly through iteration, as the app
    reads it (armed before each wait): every piece arrives once, in order, whichever path it
    took; refused pieces and a sink that raises fall back to the channel; the last piece is
    refused and comes through iteration."""
    reference = await collect(engine, job(model, PROMPTS[1], 48))
    received: list[tuple[str, Piece]] = []
    calls = 0

    def sink(piece: Piece) -> bool:
        nonlocal calls
        calls += 1
        if calls == 7:
            raise RuntimeError("a bug in a sink")
        if piece.finish_reason is not None or calls % 5 == 0:
            return False
        received.append(("direct", piece))
        return True

    with caplog.at_level(logging.ERROR, logger="llama_trio.engine"):
        async with engine.submit(job(model, PROMPTS[1], 48)) as pieces:
            iterator = pieces.__aiter__()
            while True:
                pieces.deliver_directly(sink)
                try:
                    piece = await iterator.__anext__()
                except StopAsyncIteration:
                    break
                if sum(1 for path, _ in received if path == "channel") < 2:
                    # Slow to "write" what it took: later pieces pile up in the channel and
                    # must wait, not overtake it (nor be overtaken once the sink is re-armed).
                    await trio.sleep(0.05)
                received.append(("channel", piece))
    assert "".join(p.text for _, p in received) == reference.text
    assert [t for _, p in received for t in p.tokens] == reference.tokens
    paths = [path for path, _ in received]
    # Whatever the timing: calls 1-4 are taken, 5 is refused, 6 is taken after a re-arm, 7
    # raises, and the last piece is refused.
    assert paths.count("direct") >= 5 and paths.count("channel") >= 3
    assert received[-1][0] == "channel" and received[-1][1].finish_reason == "length"
    assert "direct delivery failed" in caplog.text
    await settle(engine)
    assert engine.stats.active == 0


async def test_stop_string_across_tokens(model: ffi.Model, engine: Engine) -> None:
    full = await collect(engine, job(model, PROMPTS[1], 40))
    # A stop string that spans the boundary between two generated pieces (tokens), whatever
    # this CPU's greedy text is: two characters on each side of the first boundary that has them.
    ends = itertools.accumulate(len(text) for text in full.texts)
    offset = next(end for end in ends if 2 <= end <= len(full.text) - 2)
    stop = full.text[offset - 2 : offset + 2]
    first = full.text.find(stop)
    cut = await collect(engine, job(model, PROMPTS[1], 40, stop=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:first]
    assert stop not in cut.text
    # A stop string whose beginning appears but which never completes is released in full.
    never = full.text[offset - 2 : offset + 2] + "\x00never"
    whole = await collect(engine, job(model, PROMPTS[1], 40, stop=[never]))
    assert whole.text == full.text and whole.finish_reason == "length"


async def test_end_of_generation_token_stops(model: ffi.Model, engine: Engine) -> None:
    # The chat template's end token made the likeliest by far: the model picks it first.
    template = ffi.ChatTemplate(model.chat_template)
    prompt = template.render([{"role": "user", "content": "Say hello."}])
    (im_end,) = model.vocab.tokenize("<|im_end|>", add_special=False, parse_special=True)
    assert im_end in model.vocab.eog_tokens
    sampling = ffi.SamplingParams(temperature=0, logit_bias={im_end: 100.0})
    result = await collect(engine, Job(model.vocab.tokenize(prompt, parse_special=True), sampling, max_tokens=200))
    # It ends the job: counted, but neither text nor a token of the answer.
    assert result.finish_reason == "stop"
    assert result.completion_tokens == 1
    assert result.tokens == [] and result.text == ""


async def test_prompt_too_long_for_a_sequence(model: ffi.Model, engine: Engine) -> None:
    with pytest.raises(ContextLengthExceeded):
        async with engine.submit(Job([1] * engine.n_ctx_seq, GREEDY)):
            pass  # pragma: no cover


async def test_context_full_ends_with_length(model: ffi.Model) -> None:
    async with open_engine(model, EngineConfig(n_parallel=1, n_ctx=64, n_batch=32, n_threads=2)) as engine:
        prompt = model.vocab.tokenize(PROMPTS[1])
        result = await collect(engine, Job(prompt, endless(model), max_tokens=None))
        n_ctx_seq = engine.n_ctx_seq  # llama.cpp rounds small contexts up (to 256 cells)
    assert result.finish_reason == "length"
    assert len(prompt) + len(result.tokens) == n_ctx_seq + 1  # every cell used; the last token is never decoded


async def test_prefix_reuse(model: ffi.Model) -> None:
    shared = model.vocab.tokenize("Here is a long shared system prompt about many things. " * 20)[:200]
    first = Job([*shared, *model.vocab.tokenize(" First question: what is red?", add_special=False)], GREEDY, 16)
    second = Job(
        [*shared, *model.vocab.tokenize(" Second question: why is the sky blue?", add_special=False)], GREEDY, 16
    )
    async with open_engine(model, CONFIG) as engine:
        cold = await collect(engine, second)
    async with open_engine(model, CONFIG) as engine:
        await collect(engine, first)
        warm = await collect(engine, second)
        await settle(engine)
        assert engine.stats.kv_cells_cached > 0
    assert cold.cached_tokens == 0
    assert warm.cached_tokens >= 190
    assert warm.tokens == cold.tokens


async def test_n_choices_copy_the_prompt_and_free_every_sequence(model: ffi.Model, engine: Engine) -> None:
    greedy_one = await collect(engine, job(model, PROMPTS[0], 12))
    pieces_by_choice: dict[int, list[Piece]] = {0: [], 1: [], 2: []}
    three = Job(prompt=model.vocab.tokenize(PROMPTS[0]), sampling=GREEDY, max_tokens=12, n=3)
    async with engine.submit(three) as pieces:
        async for piece in pieces:
            pieces_by_choice[piece.index].append(piece)
    for index, received in pieces_by_choice.items():
        assert "".join(p.text for p in received) == greedy_one.text, index  # greedy: all alike
        finals = [p for p in received if p.finish_reason]
        assert len(finals) == 1 and finals[0].usage is not None
        # The prompt counts in the choice that computed it; the others had copies.
        assert finals[0].usage.prompt_tokens == (len(three.prompt) if index == 0 else 0)
    await settle(engine)
    assert engine.stats.active == 0
    assert engine.stats.kv_cells_used == engine.stats.kv_cells_cached
