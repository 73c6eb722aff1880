"""The binding against the real default model: tokenization, decoding, sampling, memory, errors."""

from __future__ import annotations

import gc
import logging
import math
import pathlib
import threading
import time
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import ffi
from ffi._lib import ffi as ffi_c
from ffi._lib import lib
from tests.support.process import NO_END_TOKENS

PROMPT = "The three primary colors are"


def generate(
    model: ffi.Model, context: ffi.Context, prompt: list[int], n: int, params: ffi.SamplingParams, seq: int = 0
) -> list[int]:
    """Plain single-sequence generation loop over the binding."""
    with ffi.Batch(max(len(prompt), 1)) as batch, ffi.Sampler(params, model.vocab.n_tokens) as sampler:
        index = batch.add_run(prompt, 0, seq, logits_last=True)
        context.decode(batch)
        out: list[int] = []
        pos = len(prompt)
        for _ in range(n):
            token = sampler.sample(context, index)
            out.append(token)
            batch.clear()
            index = batch.add(token, pos, seq, logits=True)
            pos += 1
            context.decode(batch)
    context.seq_rm(seq)
    return out


@pytest.fixture
def context(model: ffi.Model):
    with ffi.Context(model, n_ctx=1024, n_batch=256, n_seq_max=2, n_threads=2) as ctx:
        yield ctx


@pytest.mark.parametrize(
    "text",
    ["Hello, world! 123", "Crème brûlée à la façon de Zoë", "日本語のテキストと中文", "llama 🦙 and 👩‍👩‍👧 family"],
)
def test_tokenize_round_trip(model: ffi.Model, text: str) -> None:
    tokens = model.vocab.tokenize(text, add_special=False)
    assert tokens
    assert model.vocab.detokenize(tokens) == text
    detok = ffi.Detokenizer(model.vocab)
    assert detok.feed_all(tokens) + detok.flush() == text


def test_special_tokens_parse_only_when_asked(model: ffi.Model) -> None:
    text = "<|im_start|>user"
    parsed = model.vocab.tokenize(text, add_special=False, parse_special=True)
    plain = model.vocab.tokenize(text, add_special=False, parse_special=False)
    assert len(parsed) < len(plain)
    assert model.vocab.is_control(parsed[0])


def test_detokenizer_holds_split_emoji(model: ffi.Model) -> None:
    emoji = "🦙"  # four UTF-8 bytes
    tokens = model.vocab.tokenize(emoji, add_special=False)
    pieces = [model.vocab.piece(t) for t in tokens]
    assert b"".join(pieces) == emoji.encode()
    assert len(tokens) > 1, "the test needs a character split across tokens"
    detok = ffi.Detokenizer(model.vocab)
    outputs = [detok.feed(t) for t in tokens]
    assert outputs[:-1] == [""] * (len(tokens) - 1)
    assert outputs[-1] == emoji
    assert detok.flush() == ""


def test_detokenizer_replaces_invalid_bytes_at_flush(model: ffi.Model) -> None:
    detok = ffi.Detokenizer(model.vocab)
    assert detok.feed_bytes("🦙".encode()[:2]) == ""
    assert detok.flush() == "\ufffd"


def test_greedy_is_deterministic_across_runs_and_contexts(model: ffi.Model, context: ffi.Context) -> None:
    prompt = model.vocab.tokenize(PROMPT)
    greedy = ffi.SamplingParams(temperature=0)
    first = generate(model, context, prompt, 32, greedy)
    second = generate(model, context, prompt, 32, greedy)
    with ffi.Context(model, n_ctx=512, n_batch=64, n_seq_max=1, n_threads=2) as other:
        third = generate(model, other, prompt, 32, greedy)
    assert len(first) == 32
    assert first == second == third


def test_seed_reproduces_and_differs(model: ffi.Model, context: ffi.Context) -> None:
    prompt = model.vocab.tokenize(PROMPT)
    a = generate(model, context, prompt, 24, ffi.SamplingParams(temperature=1.0, seed=1234))
    b = generate(model, context, prompt, 24, ffi.SamplingParams(temperature=1.0, seed=1234))
    c = generate(model, context, prompt, 24, ffi.SamplingParams(temperature=1.0, seed=4321))
    assert a == b
    assert a != c


def test_two_sequences_in_one_batch_match_solo_runs(model: ffi.Model, context: ffi.Context) -> None:
    prompts = [model.vocab.tokenize(PROMPT), model.vocab.tokenize("Once upon a time, in a small village,")]
    greedy = ffi.SamplingParams(temperature=0)
    solo = [generate(model, context, p, 20, greedy) for p in prompts]

    samplers = [ffi.Sampler(greedy, model.vocab.n_tokens) for _ in prompts]
    batch = ffi.Batch(64)
    index = [batch.add_run(p, 0, seq, logits_last=True) for seq, p in enumerate(prompts)]
    context.decode(batch)
    pos = [len(p) for p in prompts]
    together: list[list[int]] = [[], []]
    for _ in range(20):
        tokens = [samplers[seq].sample(context, index[seq]) for seq in range(2)]
        batch.clear()
        for seq, token in enumerate(tokens):
            together[seq].append(token)
            index[seq] = batch.add(token, pos[seq], seq, logits=True)
            pos[seq] += 1
        context.decode(batch)
    batch.close()
    for s in samplers:
        s.close()
    assert together == solo


def test_removing_a_sequence_frees_its_cells(model: ffi.Model, context: ffi.Context) -> None:
    before = context.cells_used()
    prompt = model.vocab.tokenize(PROMPT)
    with ffi.Batch(len(prompt)) as batch:
        batch.add_run(prompt, 0, 1, logits_last=True)
        context.decode(batch)
    assert context.cells_used() == before + len(prompt)
    assert context.seq_cells(1) == len(prompt)
    assert context.seq_rm(1)
    assert context.cells_used() == before
    assert context.seq_pos_max(1) == -1


@pytest.mark.parametrize("unified", [True, False])
def test_a_saved_sequence_state_restores_into_another_sequence(model: ffi.Model, unified: bool) -> None:
    """What the host prompt cache relies on: a sequence's cells, copied to host memory and back
    into another sequence (also of a per-sequence KV layout), continue exactly as the original."""
    prompt = model.vocab.tokenize(PROMPT)
    with (
        ffi.Context(model, n_ctx=512, n_batch=64, n_seq_max=2, n_threads=2, kv_unified=unified) as context,
        ffi.Batch(64) as batch,
    ):
        batch.add_run(prompt[:-1], 0, 0, logits_last=False)
        context.decode(batch)
        state = bytearray(context.seq_state_size(0))
        context.seq_save(0, state)
        assert len(state) > 0
        assert context.seq_restore(state, 1)
        assert context.seq_cells(1) == len(prompt) - 1
        batch.clear()
        first = batch.add(prompt[-1], len(prompt) - 1, 0, logits=True)
        second = batch.add(prompt[-1], len(prompt) - 1, 1, logits=True)
        context.decode(batch)
        assert context.logprobs(first, 0, 5) == context.logprobs(second, 0, 5)
        context.seq_rm(0)
        context.seq_rm(1)
        assert context.cells_used() == 0
        assert not context.seq_restore(b"not a state", 1)
        assert context.seq_cells(1) == 0


def test_a_state_that_does_not_fit_is_refused_without_an_error_line(
    model: ffi.Model, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: a client restoring a slot saved under another context shape wrote
    llama.cpp's ERROR line ("n_stream mismatch") into the log each time it asked; the caller
    reports the refusal, so the line is logged at DEBUG."""
    prompt = model.vocab.tokenize(PROMPT)
    with (
        ffi.Context(model, n_ctx=512, n_batch=64, n_seq_max=4, n_threads=1, kv_unified=False) as four,
        ffi.Context(model, n_ctx=512, n_batch=64, n_seq_max=2, n_threads=1, kv_unified=True) as two,
        ffi.Batch(64) as batch,
    ):
        batch.add_run(prompt, 0, 0, logits_last=False)
        four.decode(batch)
        state = bytearray(four.seq_state_size(0))
        four.seq_save(0, state)
        caplog.clear()
        with caplog.at_level(logging.DEBUG, "llama_trio.llama_cpp"):
            assert not two.seq_restore(state, 1)
        assert two.seq_cells(1) == 0
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
        assert "error loading state" in caplog.text  # still there, at DEBUG


def test_no_end_tokens_bans_every_end_of_generation_token(model: ffi.Model) -> None:
    assert {int(token) for token in NO_END_TOKENS} >= model.vocab.eog_tokens
    assert all(bias == -100 for bias in NO_END_TOKENS.values())


def test_penalties_and_logit_bias_steer_sampling(model: ffi.Model, context: ffi.Context) -> None:
    prompt = model.vocab.tokenize(PROMPT)
    plain = generate(model, context, prompt, 8, ffi.SamplingParams(temperature=0))
    banned = plain[0]
    biased = generate(model, context, prompt, 8, ffi.SamplingParams(temperature=0, logit_bias={banned: -100.0}))
    assert banned not in biased


def _llama_greedy_chain(n_vocab: int, bias: dict[int, float]) -> Any:
    """llama.cpp's own greedy sampler (behind its logit-bias sampler), for comparison."""
    chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    if bias:
        entries = ffi_c.new("llama_logit_bias[]", len(bias))
        for i, (token, value) in enumerate(bias.items()):
            entries[i].token = token
            entries[i].bias = value
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_logit_bias(n_vocab, len(bias), entries))
    lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
    return chain


def test_fast_greedy_picks_what_llama_cpp_greedy_picks(model: ffi.Model, context: ffi.Context) -> None:
    """Over every position of a real text (one logits row each), with and without biases
    (including tokens 0 and n_vocab - 1 and the row's own winners), our one-pass greedy
    picks the same token as llama.cpp's sampler chain."""
    n_vocab = model.vocab.n_tokens
    text = "Once upon a time, in a small village by the sea, there lived an old fisherman. " * 3
    tokens = model.vocab.tokenize(text)
    with ffi.Batch(len(tokens)) as batch:
        for i, token in enumerate(tokens):
            batch.add(token, i, 0, logits=True)
        context.decode(batch)
    plain_winners = {ffi.Sampler(ffi.SamplingParams(temperature=0), n_vocab).sample(context, i) for i in range(8)}
    biases = [
        {},
        {0: 50.0, n_vocab - 1: -1.0},
        {t: float("-inf") for t in plain_winners},
        {t: -0.5 for t in range(0, n_vocab, 97)} | {n_vocab - 1: 3.0},
    ]
    for bias in biases:
        ours = ffi.Sampler(ffi.SamplingParams(temperature=0, logit_bias=bias), n_vocab)
        theirs = _llama_greedy_chain(n_vocab, bias)
        try:
            picked = [ours.sample(context, i) for i in range(len(tokens))]
            expected = [lib.llama_sampler_sample(theirs, context.ptr, i) for i in range(len(tokens))]
        finally:
            ours.close()
            lib.llama_sampler_free(theirs)
        assert picked == expected
    context.seq_rm(0)


def _ties(n: int, at: list[int]) -> list[float]:
    return [9.0 if i in at else float(i % 7) for i in range(n)]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    values=st.lists(st.floats(-5, 5, width=32) | st.sampled_from([-math.inf, 2.5]), min_size=1, max_size=300)
    | st.builds(_ties, st.integers(1, 300), st.lists(st.integers(0, 299), max_size=3)),
    data=st.data(),
)
@example(values=_ties(200, [5, 70, 130]), data=None)
@example(values=_ties(200, [70, 199]), data=None)
@example(values=_ties(130, [129, 0]), data=None)
@example(values=[-math.inf] * 100, data=None)
@example(values=[1.0] * 150, data=None)
def test_greedy_helper_is_first_index_of_the_biased_maximum(values: list[float], data: st.DataObject | None) -> None:
    """The helper against a plain reference: ties within and across its 64-value blocks and
    in the tail, biases anywhere (including -inf); it picks the first index of the maximum."""
    n = len(values)
    bias: dict[int, float] = {}
    if data is not None:
        bias = data.draw(st.dictionaries(st.integers(0, n - 1), st.floats(-3, 3, width=32) | st.just(-math.inf)))
    row = ffi_c.new("float[]", values)
    order = sorted(bias)
    picked = lib.llama_trio_greedy(
        row, n, ffi_c.new("int32_t[]", order), ffi_c.new("float[]", [bias[t] for t in order]), len(order)
    )
    biased = [ffi_c.cast("float", v + bias.get(i, 0.0)) for i, v in enumerate(values)]  # float32 sums
    scores = [float(ffi_c.cast("double", v)) for v in biased]
    assert picked == scores.index(max(scores))


def test_missing_model_raises(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ffi.ModelLoadError, match="not found"):
        ffi.Model(tmp_path / "nope.gguf")


def test_not_a_gguf_raises(tmp_path: pathlib.Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"this is not a model" * 100)
    with pytest.raises(ffi.ModelLoadError, match="not a GGUF"):
        ffi.Model(bogus)


def test_truncated_gguf_raises(tmp_path: pathlib.Path, model_path: pathlib.Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    with open(model_path, "rb") as src:
        truncated.write_bytes(src.read(2 * 1024 * 1024))
    with pytest.raises(ffi.ModelLoadError):
        ffi.Model(truncated)


def test_interrupt_stops_a_decode_from_another_thread_and_resume_lets_decodes_run(
    model: ffi.Model, caplog: pytest.LogCaptureFixture
) -> None:
    """``interrupt`` ends a decode in progress (or the next one) with ``DecodeAbortedError``;
    only whole ubatches before the one it stopped stay in the KV memory; after ``resume`` the
    same context decodes again as if nothing happened. llama.cpp's errors for the stop are
    logged at DEBUG, not as errors (a client that leaves is none)."""
    caplog.set_level(logging.DEBUG, "llama_trio.llama_cpp")
    prompt = (model.vocab.tokenize(PROMPT) * 200)[:2000]
    with (
        ffi.Context(model, n_ctx=2048, n_batch=2048, n_ubatch=256, n_seq_max=1, n_threads=1) as context,
        ffi.Batch(len(prompt)) as batch,
    ):
        batch.add_run(prompt[:8], 0, 0, logits_last=True)
        context.interrupt()  # before the decode: it stops at its first node
        with pytest.raises(ffi.DecodeAbortedError):
            context.decode(batch)
        assert context.seq_cells(0) == 0
        context.resume()
        batch.clear()
        batch.add_run(prompt, 0, 0, logits_last=True)
        outcome: list[BaseException | None] = []

        def decode() -> None:
            try:
                context.decode(batch)
                outcome.append(None)
            except ffi.DecodeError as exc:
                outcome.append(exc)

        thread = threading.Thread(target=decode)
        thread.start()
        time.sleep(0.05)
        context.interrupt()
        thread.join(60)
        assert len(outcome) == 1 and isinstance(outcome[0], ffi.DecodeAbortedError), outcome
        kept = context.seq_cells(0)
        assert kept % 256 == 0 and kept < len(prompt), kept
        assert context.seq_pos_max(0) == kept - 1
        context.resume()
        context.seq_rm(0)
        batch.clear()
        batch.add_run(prompt[:8], 0, 0, logits_last=True)
        context.decode(batch)
        assert context.seq_cells(0) == 8
    stops = [r for r in caplog.records if r.getMessage().startswith("llama_decode: failed to decode")]
    assert len(stops) == 2 and all(r.levelno == logging.DEBUG for r in stops), caplog.records
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_close_is_idempotent_and_use_after_close_raises(model_path: pathlib.Path) -> None:
    model = ffi.Model(model_path)
    context = ffi.Context(model, n_ctx=256, n_batch=32, n_threads=1)
    sampler = ffi.Sampler(ffi.SamplingParams(), model.vocab.n_tokens)
    batch = ffi.Batch(8)
    batch.add(model.vocab.bos, 0, 0, logits=True)
    model.close()  # closes the context made from it too
    model.close()
    assert context.closed
    context.close()
    sampler.close()
    sampler.close()
    batch.close()
    batch.close()
    with pytest.raises(ffi.ClosedError):
        model.vocab.tokenize("x")
    with pytest.raises(ffi.ClosedError):
        context.cells_used()
    with pytest.raises(ffi.ClosedError):
        sampler.reset()
    with pytest.raises(ffi.ClosedError):
        batch.add(1, 0, 0, logits=False)
    with pytest.raises(ffi.ClosedError):
        ffi.Context(model)


def test_chat_template_renders_content_as_text(model: ffi.Model) -> None:
    template = ffi.ChatTemplate(model.chat_template)
    evil = "{{ 7 * 7 }} {% for x in range(3) %}x{% endfor %} {{ ''.__class__.__mro__ }}"
    prompt = template.render([{"role": "user", "content": evil}])
    assert evil in prompt
    assert "49" not in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_chat_template_sandbox_blocks_escape() -> None:
    template = ffi.ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ffi.TemplateError):
        template.render([{"role": "user", "content": "hi"}])


def test_builtin_template_fallback() -> None:
    template = ffi.ChatTemplate(None)  # no template in the model: chatml via llama.cpp
    prompt = template.render([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_logprobs_match_a_log_softmax_of_the_same_logits(model: ffi.Model, context: ffi.Context) -> None:
    from ffi._lib import ffi as ffi_c
    from ffi._lib import lib as lib_c

    prompt = model.vocab.tokenize("The capital of France is", add_special=True)
    with ffi.Batch(64) as batch:
        index = batch.add_run(prompt, 0, 0, logits_last=True)
        context.decode(batch)
    n = model.vocab.n_tokens
    row = lib_c.llama_get_logits_ith(context.ptr, index)
    logits = [float(v) for v in ffi_c.unpack(row, n)]
    top = max(logits)
    lse = top + math.log(sum(math.exp(v - top) for v in logits))
    expected = sorted(range(n), key=lambda t: (-logits[t], t))[:5]
    for token in (expected[0], expected[3], 7):
        chosen, alternatives = context.logprobs(index, token, 5)
        assert chosen == pytest.approx(logits[token] - lse, abs=1e-4)
        assert [t for t, _ in alternatives] == expected
        assert [lp for _, lp in alternatives] == pytest.approx([logits[t] - lse for t in expected], abs=1e-4)
    assert sum(math.exp(lp) for _, lp in context.logprobs(index, 0, 20)[1]) <= 1.0
    assert context.logprobs(index, expected[0], 0)[1] == []
    # A token masked to -inf has probability 0.
    row[7] = float("-inf")
    assert context.logprobs(index, 7, 1)[0] == float("-inf")


def test_a_refused_batch_capacity_leaves_nothing_to_free() -> None:
    # The finaliser of a batch whose __init__ raised must not fail in its turn (pytest makes an
    # unraisable exception in a finaliser an error).
    for capacity in (0, -1):
        with pytest.raises(ValueError, match="capacity"):
            ffi.Batch(capacity)
    gc.collect()


def test_a_vocabulary_only_model_loads_and_tokenizes(model_path: pathlib.Path, model: ffi.Model) -> None:
    # Its shape reads as empty rather than aborting the process (llama.cpp asserts on a head
    # count of a model without layers).
    with ffi.Model(model_path, vocab_only=True) as vocab_only:
        assert (vocab_only.n_layer, vocab_only.n_head, vocab_only.n_head_kv) == (0, 0, 0)
        assert vocab_only.vocab.tokenize("Hello there", add_special=False) == model.vocab.tokenize(
            "Hello there", add_special=False
        )
        assert ffi.kv_cache_bytes(vocab_only, 4096, 4, ffi.Attention()) == 0


def test_the_fingerprint_tells_two_models_of_one_shape_apart(
    tiny_model_path: pathlib.Path, model_path: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Found by review: the fingerprint hashed the description, size and parameter count only,
    so a slot saved with one model was restored into another of the same shape (a base and its
    fine-tune), silently changing its answers. Now it covers samples of the file's bytes."""
    from bench.random_model import SHAPES, write_model

    other = tmp_path / "other.gguf"
    write_model(model_path, other, SHAPES["tiny"], seed=1)
    with ffi.Model(tiny_model_path) as a, ffi.Model(other) as b, ffi.Model(tiny_model_path) as again:
        assert (a.description, a.size_bytes, a.n_params) == (b.description, b.size_bytes, b.n_params)
        assert a.fingerprint() != b.fingerprint()
        assert a.fingerprint() == again.fingerprint()  # stable for the same file


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_pooled_embeddings_with_every_token_an_output(
    model: ffi.Model, caplog: pytest.LogCaptureFixture, pooling: str
) -> None:
    """Found by review: the embedder marked only each input's last token an output, so llama.cpp
    marked them all itself and warned on every decode ("embeddings required but some input
    tokens were not marked as outputs -> overriding"). Marked all (``all_outputs``), it does not
    warn, and the vectors are the very same: llama.cpp computed that batch before too."""
    caplog.set_level(logging.WARNING, "llama_trio.llama_cpp")
    prompts = [model.vocab.tokenize(PROMPT), model.vocab.tokenize("A second input, longer than the first one.")]
    vectors = {}
    with (
        ffi.Context(model, n_ctx=256, n_batch=64, n_seq_max=2, n_threads=2, embeddings=True, pooling=pooling) as ctx,
        ffi.Batch(64) as batch,
    ):
        for all_outputs in (False, True):
            batch.clear()
            for seq, prompt in enumerate(prompts):
                batch.add_run(prompt, 0, seq, logits_last=True, all_outputs=all_outputs)
            caplog.clear()
            ctx.decode(batch)
            assert ("not marked as outputs" in caplog.text) is not all_outputs, caplog.text
            vectors[all_outputs] = [ctx.embedding(seq) for seq in range(len(prompts))]
            ctx.clear()
    assert vectors[True] == vectors[False]
