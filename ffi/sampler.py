"""``SamplingParams`` and ``Sampler``: one llama.cpp sampler chain per sequence."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ffi._lib import ffi, lib
from ffi.context import Context
from ffi.errors import ClosedError

# LLAMA_DEFAULT_SEED: llama.cpp's dist sampler draws a random seed when given this one.
RANDOM_SEED = 0xFFFFFFFF
# llama.cpp's penalty sampler looks back this many tokens (llama-server's default too).
PENALTY_LAST_N = 64


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. ``temperature <= 0`` means greedy (argmax after biases and
    penalties); ``top_k <= 0``, ``top_p >= 1`` and ``min_p <= 0`` switch those filters off;
    ``seed`` is any integer (``dist_seed``); None draws a fresh random seed."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class TokenMask:
    """One bit per token (``uint32_t`` words, bit ``i % 32`` of word ``i // 32``): the memory a
    grammar engine writes the allowed tokens into and ``Sampler.sample`` reads. Plain memory,
    freed with the object."""

    def __init__(self, n_vocab: int) -> None:
        self.n_words = (n_vocab + 31) // 32
        self.words: Any = ffi.new("uint32_t[]", self.n_words)
        self.address = int(ffi.cast("uintptr_t", self.words))
        self.nbytes = 4 * self.n_words


def dist_seed(seed: int) -> int:
    """The seed llama.cpp's dist sampler gets for ``seed`` (any integer): one of the 2**32 - 1
    seeds it takes as they are, never ``RANDOM_SEED`` (which it would replace with a random
    one), so every seed reproduces. Seeds from 0 to 2**32 - 2 are themselves."""
    return seed % RANDOM_SEED


def _has_penalties(params: SamplingParams) -> bool:
    return params.repeat_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


class Sampler:
    """A sampler chain built from ``SamplingParams``; ``sample`` picks a token from the logits
    at a batch index and records it (for penalties). ``close()`` is idempotent.

    Greedy sampling without penalties (logit biases allowed) skips the chain: one C pass over
    the logits row (``llama_trio_greedy``) picks the same token as llama.cpp's greedy sampler
    without copying the vocabulary into candidate structs first (about half the cost per token
    right after a decode, when the row is not yet in this core's cache; a seventh when it is)."""

    def __init__(self, params: SamplingParams, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self._fast: tuple[Any, Any, int] | None = None
        if params.greedy and not _has_penalties(params):
            in_vocab = sorted((t, b) for t, b in params.logit_bias.items() if 0 <= t < n_vocab)
            self._fast = (
                ffi.new("int32_t[]", [t for t, _ in in_vocab]),
                ffi.new("float[]", [b for _, b in in_vocab]),
                len(in_vocab),
            )
        chain_params = lib.llama_sampler_chain_default_params()
        chain_params.no_perf = True
        chain = lib.llama_sampler_chain_init(chain_params)
        self._ptr: Any = ffi.gc(chain, lib.llama_sampler_free)
        self.seed = dist_seed(params.seed) if params.seed is not None else secrets.randbelow(RANDOM_SEED)
        if params.logit_bias:
            biases = ffi.new("llama_logit_bias[]", len(params.logit_bias))
            for i, (token, bias) in enumerate(params.logit_bias.items()):
                biases[i].token = token
                biases[i].bias = bias
            self._add(lib.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), biases))
        if _has_penalties(params):
            self._add(
                lib.llama_sampler_init_penalties(
                    n_vocab,
                    PENALTY_LAST_N,
                    params.repeat_penalty,
                    params.frequency_penalty,
                    params.presence_penalty,
                )
            )
        if params.greedy:
            self._add(lib.llama_sampler_init_greedy())
            return
        if params.top_k > 0:
            self._add(lib.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            self._add(lib.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            self._add(lib.llama_sampler_init_min_p(params.min_p, 1))
        self._add(lib.llama_sampler_init_temp(params.temperature))
        self._add(lib.llama_sampler_init_dist(self.seed))

    def _add(self, sampler: Any) -> None:
        # The chain owns what is added to it and frees it with itself.
        lib.llama_sampler_chain_add(self._ptr, sampler)

    @property
    def ptr(self) -> Any:
        if self._ptr is None:
            raise ClosedError("sampler is closed")
        return self._ptr

    def sample(self, context: Context, index: int, mask: TokenMask | None = None) -> int:
        """The next token from the logits at batch ``index`` of the last decode (accepted).

        ``mask`` (a ``TokenMask``) allows only the tokens whose bit is set: the others' logits
        are set to -inf in the context's row first, so every sampler in the chain sees it."""
        fast = self._fast
        if fast is not None or mask is not None:
            self.ptr  # noqa: B018 - raises when closed
            logits = lib.llama_get_logits_ith(context.ptr, index)
            if logits == ffi.NULL:
                raise IndexError(f"no logits at batch index {index}")
            if mask is not None:
                lib.llama_trio_apply_mask(logits, self.n_vocab, mask.words)
            if fast is not None:
                return int(lib.llama_trio_greedy(logits, self.n_vocab, fast[0], fast[1], fast[2]))
        return int(lib.llama_sampler_sample(self.ptr, context.ptr, index))

    def accept(self, token: int) -> None:
        """Record a token the sampler did not pick (e.g. prompt tokens, for penalties)."""
        lib.llama_sampler_accept(self.ptr, token)

    def reset(self) -> None:
        lib.llama_sampler_reset(self.ptr)

    def close(self) -> None:
        if self._ptr is not None:
            ptr, self._ptr = self._ptr, None
            ffi.release(ptr)

    def __enter__(self) -> Sampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
