"""Fast-forward in the engine, with the real model: the tokens a grammar forces go into one
decode step, answers still follow their grammars, and stop strings, ``max_tokens``, the
context's end, log-probabilities and cancellation inside forced runs behave as token by token.
Every assertion holds by construction (the grammar fixes the text) or compares runs on this
machine."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import pytest
import trio

import ffi
from server.engine import Engine, EngineConfig, Job, Piece, TokenLogprob, open_engine
from server.engine.grammar import Grammar, GrammarCache, build_tokenizer

GREEDY = ffi.SamplingParams(temperature=0)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
# Almost all forced: only the first token, the boolean and the closing brace are chosen.
CONST = {
    "type": "object",
    "properties": {"kind": {"const": "person"}, "ok": {"type": "boolean"}},
    "required": ["kind", "ok"],
    "additionalProperties": False,
}
FORCED_TEXT = '{"kind": "person", "ok": '
LONG = {"type": "array", "items": {"const": "the quick brown fox jumps over the lazy dog"}, "minItems": 60}


def config(fast_forward: bool = True, **kw: int) -> EngineConfig:
    return EngineConfig(
        **{"n_parallel": 4, "n_ctx": 4096, "n_batch": 128, "n_threads": 2, **kw}, fast_forward=fast_forward
    )  # type: ignore[arg-type]


@dataclass
class Answer:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0


async def answer(engine: Engine, job: Job) -> Answer:
    result = Answer()
    async with engine.submit(job) as pieces:
        async for piece in pieces:
            result.pieces.append(piece)
            result.text += piece.text
            result.tokens += piece.tokens
            result.logprobs += piece.logprobs
            if piece.finish_reason:
                assert piece.usage is not None
                result.finish_reason, result.completion_tokens = piece.finish_reason, piece.usage.completion_tokens
    return result


@pytest.fixture(scope="module")
def grammars(model: ffi.Model) -> GrammarCache:
    return GrammarCache(build_tokenizer(model.vocab, model.vocab.eog_tokens))


@pytest.fixture(scope="module")
def prompt(model: ffi.Model) -> list[int]:
    template = ffi.ChatTemplate(model.chat_template)
    text = template.render([{"role": "user", "content": "Describe a fictional person as JSON."}])
    return model.vocab.tokenize(text, parse_special=True)


def schema_job(grammars: GrammarCache, prompt: list[int], schema: dict[str, Any], **kw: Any) -> Job:
    grammar: Grammar = grammars.build("json_schema", json.dumps(schema))  # (small: any stack holds it)
    return Job(prompt=prompt, sampling=GREEDY, grammar=grammar, **{"max_tokens": 100, **kw})


@pytest.mark.parametrize("fast_forward", [True, False], ids=["fast-forward", "token-by-token"])
async def test_a_forced_run_takes_one_decode_step(
    model: ffi.Model, grammars: GrammarCache, prompt: list[int], fast_forward: bool
) -> None:
    async with open_engine(model, config(fast_forward)) as engine:
        result = await answer(engine, schema_job(grammars, prompt, PERSON))
        steps, forced = engine.stats.decode_steps, engine.stats.forced_tokens
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.text), PERSON)
    assert result.completion_tokens == len(result.tokens)
    # One step for the prompt, then one per run (a sampled token and the tokens forced after
    # it); the last run ends the answer and is never decoded.
    if fast_forward:
        assert forced > 0 and any(len(p.tokens) > 1 for p in result.pieces)
        assert steps == len(result.tokens) - forced < len(result.tokens)
    else:
        assert forced == 0 and steps == len(result.tokens)


async def test_stop_strings_and_max_tokens_inside_forced_runs(
    model: ffi.Model, grammars: GrammarCache, prompt: list[int]
) -> None:
    async with open_engine(model, config()) as engine:
        whole = await answer(engine, schema_job(grammars, prompt, CONST))
        assert whole.text.startswith(FORCED_TEXT) and whole.finish_reason == "stop"
        assert any("person" in p.text and len(p.tokens) > 1 for p in whole.pieces)  # inside a run
        stopped = await answer(engine, schema_job(grammars, prompt, CONST, stop=["person"]))
        assert (stopped.text, stopped.finish_reason) == ('{"kind": "', "stop")
        for limit in range(1, len(whole.tokens)):
            cut = await answer(engine, schema_job(grammars, prompt, CONST, max_tokens=limit))
            assert cut.finish_reason == "length", limit
            assert cut.completion_tokens == len(cut.tokens) == limit
            assert cut.tokens == whole.tokens[:limit] and whole.text.startswith(cut.text)


async def test_a_forced_run_stops_at_the_end_of_the_context(
    model: ffi.Model, grammars: GrammarCache, prompt: list[int]
) -> None:
    async with open_engine(model, config(n_parallel=1, n_ctx=64, n_batch=128)) as engine:
        result = await answer(engine, schema_job(grammars, prompt, LONG, max_tokens=None))
        n_ctx_seq = engine.n_ctx_seq
        forced = engine.stats.forced_tokens
    assert result.finish_reason == "length" and forced > 100
    assert len(prompt) + len(result.tokens) == n_ctx_seq + 1  # every cell used, as token by token


async def test_logprobs_of_forced_tokens_come_from_the_same_decode(
    model: ffi.Model, grammars: GrammarCache, prompt: list[int]
) -> None:
    async with open_engine(model, config()) as engine:
        result = await answer(engine, schema_job(grammars, prompt, PERSON, logprobs=3))
        steps, forced = engine.stats.decode_steps, engine.stats.forced_tokens
    jsonschema.validate(json.loads(result.text), PERSON)
    assert [item.token for item in result.logprobs] == result.tokens
    assert len(result.tokens) == result.completion_tokens
    for piece in result.pieces:
        assert [item.token for item in piece.logprobs] == list(piece.tokens)
    for item in result.logprobs:
        assert -1e30 < item.logprob <= 0 and 1 <= len(item.top) <= 3
    # Still one step per run (the run is judged after its decode: at most one step more).
    assert forced > 0 and steps <= len(result.tokens) - forced + 1


async def test_cancelling_between_forced_runs_frees_the_sequence(
    model: ffi.Model, grammars: GrammarCache, prompt: list[int]
) -> None:
    async with open_engine(model, config()) as engine:
        async with engine.submit(schema_job(grammars, prompt, LONG, max_tokens=400)) as pieces:
            async for piece in pieces:
                if len(piece.tokens) > 1:
                    break
        with trio.fail_after(60):
            while engine.busy:
                await trio.sleep(0.01)
        engine._wake()
        await trio.sleep(0.05)
        assert engine.stats.active == 0 and engine.stats.cancellations["generate"] == 1
        assert engine.stats.kv_cells_used == engine.stats.kv_cells_cached
        assert engine.stats.generated_tokens < 200
