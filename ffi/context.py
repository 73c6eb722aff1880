"""``Context`` (a llama_context with its KV memory) and ``Batch`` (a reusable llama_batch)."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ffi._lib import decoding, ffi, lib, log_lines, restoring
from ffi.errors import ClosedError, ContextError, check_decode
from ffi.model import Model

if TYPE_CHECKING:
    from ffi.sampler import TokenMask


class Batch:
    """A ``llama_batch`` of up to ``capacity`` tokens, each in one sequence, reused across steps.

    ``clear()`` empties it without reallocating. ``add`` appends one token; ``add_run`` appends
    consecutive positions of one sequence in a few bulk copies (prompt chunks). The index of each
    token that asked for logits is what ``Sampler.sample`` takes.
    """

    _raw: Any = None  # until __init__ allocates: a refused capacity leaves nothing to free

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("batch capacity must be positive")
        self.capacity = capacity
        self._raw = lib.llama_batch_init(capacity, 0, 1)
        self.n_tokens = 0

    @property
    def raw(self) -> Any:
        if self._raw is None:
            raise ClosedError("batch is closed")
        return self._raw

    def clear(self) -> None:
        self.n_tokens = 0

    @property
    def free(self) -> int:
        return self.capacity - self.n_tokens

    def add(self, token: int, pos: int, seq_id: int, logits: bool) -> int:
        """Append one token; returns its index in the batch."""
        i = self.n_tokens
        if i >= self.capacity:
            raise OverflowError("batch is full")
        raw = self.raw
        raw.token[i] = token
        raw.pos[i] = pos
        raw.n_seq_id[i] = 1
        raw.seq_id[i][0] = seq_id
        raw.logits[i] = logits
        self.n_tokens = i + 1
        return i

    def add_run(
        self, tokens: Sequence[int], start_pos: int, seq_id: int, logits_last: bool, *, all_outputs: bool = False
    ) -> int:
        """Append ``tokens`` at positions ``start_pos...``; logits only for the last one when
        ``logits_last``, every token an output when ``all_outputs`` (what a context that makes
        embeddings needs: llama.cpp marks them all itself otherwise, with a warning each
        decode). Returns the batch index of the last token."""
        n = len(tokens)
        i = self.n_tokens
        end = i + n
        if n == 0 or end > self.capacity:
            raise OverflowError("run does not fit in the batch")
        raw = self.raw
        raw.token[i:end] = tokens
        raw.pos[i:end] = range(start_pos, start_pos + n)
        raw.n_seq_id[i:end] = [1] * n
        raw.logits[i:end] = [int(all_outputs)] * n
        seq_ptrs = raw.seq_id
        for k in range(i, end):
            seq_ptrs[k][0] = seq_id
        if logits_last:
            raw.logits[end - 1] = 1
        self.n_tokens = end
        return end - 1

    def close(self) -> None:
        """Free the batch. Idempotent."""
        if self._raw is not None:
            raw, self._raw = self._raw, None
            lib.llama_batch_free(raw)

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # safety net only; owners call close()
        self.close()


CACHE_TYPES = {
    "f32": lib.GGML_TYPE_F32,
    "f16": lib.GGML_TYPE_F16,
    "bf16": lib.GGML_TYPE_BF16,
    "q8_0": lib.GGML_TYPE_Q8_0,
    "q4_0": lib.GGML_TYPE_Q4_0,
    "q4_1": lib.GGML_TYPE_Q4_1,
    "iq4_nl": lib.GGML_TYPE_IQ4_NL,
    "q5_0": lib.GGML_TYPE_Q5_0,
    "q5_1": lib.GGML_TYPE_Q5_1,
}
_KV_BUFFER_LINE = re.compile(r"llama_kv_cache\S*: +(\S+) KV buffer size = +([0-9.]+) MiB")
_MIB = 1024 * 1024
_UNQUANTIZED = frozenset({"f32", "f16", "bf16"})
FLASH_ATTN = {
    "auto": lib.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": lib.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}


@dataclass(frozen=True)
class Attention:
    """How a context computes attention and keeps its KV cache: flash attention ("auto": where
    the device supports it), the K and V cache types (``CACHE_TYPES``; a quantized V cache needs
    flash attention), and whether the KV cache sits on the offload devices with the layers."""

    flash_attn: str = "auto"
    type_k: str = "f16"
    type_v: str = "f16"
    offload_kv: bool = True

    def __post_init__(self) -> None:
        if self.flash_attn not in FLASH_ATTN:
            raise ValueError(f"flash_attn must be one of {', '.join(FLASH_ATTN)}")
        for name in (self.type_k, self.type_v):
            if name not in CACHE_TYPES:
                raise ValueError(f"KV cache type {name!r} is not one of {', '.join(CACHE_TYPES)}")
        if self.flash_attn == "off" and self.type_v not in _UNQUANTIZED:
            raise ValueError(f"a {self.type_v} V cache needs flash attention (on or auto)")


def kv_cache_bytes(
    model: Model,
    n_ctx: int,
    n_seq_max: int,
    attention: Attention,
    layers: int | None = None,
    *,
    unified: bool = False,
) -> int | None:
    """The KV cache a context of ``n_ctx`` cells for ``n_seq_max`` sequences (one stream each
    unless ``unified``) will allocate for ``layers`` of ``model``'s layers (all by default),
    from the model's hyperparameters, before llama.cpp allocates (and clears) it: a K and a V
    row of the layer's KV heads per cell, the cells padded as llama.cpp pads them
    (``padded_cells``). A lower bound for a sliding-window model (its layers all counted at the
    window). None where the shape is not one this can tell: a recurrent or hybrid model's state,
    a latent-attention cache, layers sharing their KV, KV heads that vary by layer, an encoder's
    attention (none kept)."""
    arch = model.meta("general.architecture") or ""
    if model.meta(f"{arch}.attention.causal") == "false":  # an encoder (BERT): llama.cpp keeps no cache
        return None
    if model.recurrent or any(
        model.meta(f"{arch}.attention.{key}") is not None for key in ("kv_lora_rank", "shared_kv_layers")
    ):
        return None
    heads = model.meta(f"{arch}.attention.head_count_kv")
    if heads is not None and not heads.isdigit():  # an array: a count per layer
        return None
    head_k = _meta_int(model, f"{arch}.attention.key_length") or model.n_embd // max(model.n_head, 1)
    head_v = _meta_int(model, f"{arch}.attention.value_length") or head_k
    cells = padded_cells(n_ctx, n_seq_max, unified=unified)
    if model.n_swa > 0:
        cells = min(cells, model.n_swa * n_seq_max)
    per_cell = lib.ggml_row_size(CACHE_TYPES[attention.type_k], head_k * model.n_head_kv) + lib.ggml_row_size(
        CACHE_TYPES[attention.type_v], head_v * model.n_head_kv
    )
    return int(cells * per_cell * (model.n_layer if layers is None else layers))


def padded_cells(n_ctx: int, n_seq_max: int, *, unified: bool = False) -> int:
    """The cells llama.cpp makes for ``n_ctx`` asked: a multiple of 256, and without a unified
    cache, each sequence's share a multiple of 256 too (``llama_context``'s constructor)."""
    cells = -(-n_ctx // 256) * 256
    if unified:
        return cells
    return -(-(cells // n_seq_max) // 256) * 256 * n_seq_max


def _meta_int(model: Model, key: str) -> int | None:
    value = model.meta(key)
    return int(value) if value is not None and value.isdigit() else None


POOLING = {
    "none": lib.LLAMA_POOLING_TYPE_NONE,
    "mean": lib.LLAMA_POOLING_TYPE_MEAN,
    "cls": lib.LLAMA_POOLING_TYPE_CLS,
    "last": lib.LLAMA_POOLING_TYPE_LAST,
}


class Context:
    """A llama.cpp context: the KV memory for ``n_seq_max`` sequences sharing ``n_ctx`` cells.

    ``decode`` blocks for the whole forward pass: call it from a worker thread in async code,
    and never call two methods of one context at the same time. ``close()`` is idempotent; any
    later use raises ``ClosedError``.
    """

    def __init__(
        self,
        model: Model,
        *,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        n_seq_max: int = 1,
        n_threads: int = 4,
        n_threads_batch: int | None = None,
        kv_unified: bool = True,
        embeddings: bool = False,
        pooling: str | None = None,
        attention: Attention = Attention(),
    ) -> None:
        """``embeddings``: the context computes one pooled embedding per sequence (``pooling``:
        "mean", "cls", "last"; None: the model's own) instead of logits. The
        ``llama_context_params`` given to llama.cpp stay readable as ``params``."""
        params = lib.llama_context_default_params()
        params.flash_attn_type = FLASH_ATTN[attention.flash_attn]
        params.type_k = CACHE_TYPES[attention.type_k]
        params.type_v = CACHE_TYPES[attention.type_v]
        params.offload_kqv = attention.offload_kv
        params.embeddings = embeddings
        if pooling is not None:
            params.pooling_type = POOLING[pooling]
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_ubatch or n_batch
        params.n_seq_max = n_seq_max
        params.n_threads = n_threads
        params.n_threads_batch = n_threads_batch or n_threads
        params.kv_unified = kv_unified
        params.no_perf = True
        self._interrupted: Any = ffi.new("int32_t *")  # lives as long as the context: llama.cpp reads it
        params.abort_callback = lib.llama_trio_flag_cb
        params.abort_callback_data = self._interrupted
        with log_lines() as lines:
            ptr = lib.llama_init_from_model(model.ptr, params)
        if ptr == ffi.NULL:
            errors = [text for level, text in lines if level >= logging.ERROR]
            raise ContextError(
                f"llama.cpp could not create a context (n_ctx={n_ctx}, n_batch={n_batch}, n_seq_max={n_seq_max}, "
                f"KV cache {attention.type_k}/{attention.type_v}, flash attention {attention.flash_attn})"
                + (f": {errors[0]}" if errors else "")
            )
        self.params: Any = params
        self.attention = attention
        self.model = model
        self._ptr: Any = ffi.gc(ptr, lib.llama_free)
        self._mem: Any = lib.llama_get_memory(ptr)
        self.n_ctx: int = lib.llama_n_ctx(ptr)
        self.n_ctx_seq: int = lib.llama_n_ctx_seq(ptr)
        self.n_batch: int = lib.llama_n_batch(ptr)
        self.n_seq_max: int = lib.llama_n_seq_max(ptr)
        # The KV cache's buffers as llama.cpp allocated them: bytes per device ("CPU", "CUDA0").
        self.kv_buffers: dict[str, int] = {}
        for _, text in lines:
            match = _KV_BUFFER_LINE.search(text)
            if match:
                device = match.group(1)
                self.kv_buffers[device] = self.kv_buffers.get(device, 0) + round(float(match.group(2)) * _MIB)
        model._register(self)

    @property
    def pooling(self) -> str:
        """How this context pools embeddings: "none", "mean", "cls", "last" or "other"."""
        kind = lib.llama_pooling_type(self.ptr)
        return next((name for name, value in POOLING.items() if value == kind), "other")

    def embedding(self, seq_id: int) -> list[float]:
        """The pooled embedding of ``seq_id`` after the last decode (an embeddings context with
        pooling)."""
        row = lib.llama_get_embeddings_seq(self.ptr, seq_id)
        if row == ffi.NULL:
            raise ContextError(f"no pooled embedding for sequence {seq_id} (is pooling on?)")
        return list(ffi.unpack(row, lib.llama_model_n_embd(self.model.ptr)))

    @property
    def ptr(self) -> Any:
        if self._ptr is None:
            raise ClosedError("context is closed")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def decode(self, batch: Batch) -> None:
        """Run the model over ``batch``; raises a ``DecodeError`` subclass on failure."""
        raw = batch.raw
        raw.n_tokens = batch.n_tokens
        decoding(self._interrupted)  # its errors for an interrupt are logged as what they are
        check_decode(lib.llama_decode(self.ptr, raw))

    def interrupt(self) -> None:
        """Stop the decode in progress, from any thread: on the CPU backend it ends at the next
        node of its graph and raises ``DecodeAbortedError`` (the positions of the ubatch it was
        on leave the KV memory; earlier ubatches of its batch stay). Every later decode stops at
        once too, until ``resume``. A backend that cannot stop (CUDA) finishes the decode."""
        lib.llama_trio_flag_store(self._interrupted, 1)

    def resume(self) -> None:
        """Let decodes run again after ``interrupt``."""
        lib.llama_trio_flag_store(self._interrupted, 0)

    # -- KV memory, per sequence -------------------------------------------------------------

    def logprobs(
        self, index: int, token: int, k: int, mask: TokenMask | None = None
    ) -> tuple[float, list[tuple[int, float]]]:
        """Log-probabilities at batch ``index`` of the last decode, from its logits row as it is
        now (a grammar's mask applied there counts): that of ``token``, and the ``k`` (at most
        20) most likely tokens with theirs, most likely first. ``mask`` (a ``TokenMask``), when
        given, is applied to the row first, as ``Sampler.sample`` applies it."""
        logits = lib.llama_get_logits_ith(self.ptr, index)
        if logits == ffi.NULL:
            raise IndexError(f"no logits at batch index {index}")
        n_vocab = self.model.vocab.n_tokens
        if mask is not None:
            lib.llama_trio_apply_mask(logits, n_vocab, mask.words)
        k = max(0, min(k, 20))
        tokens = ffi.new("int32_t[]", max(k, 1))
        values = ffi.new("float[]", max(k, 1))
        chosen = lib.llama_trio_logprobs(logits, n_vocab, token, k, tokens, values)
        return float(chosen), [(int(tokens[j]), float(values[j])) for j in range(k)]

    def _memory(self) -> Any:
        self.ptr  # noqa: B018 - raises when closed
        return self._mem

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove the cells of ``seq_id`` at positions [p0, p1) (-1: open end). Removing a whole
        sequence never fails; a partial removal may (returns False)."""
        return bool(lib.llama_memory_seq_rm(self._memory(), seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make ``dst`` share the cells of ``src`` at positions [p0, p1)."""
        lib.llama_memory_seq_cp(self._memory(), src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        """Remove every cell that does not belong to ``seq_id``."""
        lib.llama_memory_seq_keep(self._memory(), seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position held for ``seq_id``, -1 when it holds none."""
        return int(lib.llama_memory_seq_pos_max(self._memory(), seq_id))

    def seq_pos_min(self, seq_id: int) -> int:
        return int(lib.llama_memory_seq_pos_min(self._memory(), seq_id))

    def seq_cells(self, seq_id: int) -> int:
        """Cells held by ``seq_id`` (its positions are contiguous, so max - min + 1)."""
        hi = self.seq_pos_max(seq_id)
        return 0 if hi < 0 else hi - self.seq_pos_min(seq_id) + 1

    def seq_state_size(self, seq_id: int) -> int:
        """Bytes that ``seq_save`` writes for ``seq_id`` now."""
        return int(lib.llama_state_seq_get_size(self.ptr, seq_id))

    def seq_save(self, seq_id: int, buffer: Any) -> None:
        """Copy ``seq_id``'s state (its KV cells and their positions) into ``buffer`` (writable,
        exactly ``seq_state_size`` bytes), for ``seq_restore``. Blocking for a few ms per
        thousand cells: call it off the event loop."""
        size = len(buffer)
        written = lib.llama_state_seq_get_data(self.ptr, ffi.from_buffer("uint8_t[]", buffer), size, seq_id)
        if written != size:
            raise ContextError(f"sequence {seq_id}: {written} bytes of state copied into a buffer of {size}")

    def seq_restore(self, data: Any, seq_id: int) -> bool:
        """Load a state from ``seq_save`` (of any sequence of a context like this one) into
        ``seq_id``, which should hold no cells. False when llama.cpp could not (no room); then
        ``seq_id`` holds nothing."""
        with restoring():
            read = lib.llama_state_seq_set_data(self.ptr, ffi.from_buffer("uint8_t[]", data), len(data), seq_id)
        if read == 0:
            self.seq_rm(seq_id)
            return False
        return True

    def cells_used(self) -> int:
        """Cells held by all sequences together (shared cells counted once per sequence)."""
        return sum(self.seq_cells(s) for s in range(self.n_seq_max))

    def clear(self) -> None:
        """Drop every sequence's cells."""
        lib.llama_memory_clear(self._memory(), True)

    def close(self) -> None:
        """Free the context. Idempotent."""
        if self._ptr is not None:
            ptr, self._ptr = self._ptr, None
            self._mem = None
            ffi.release(ptr)

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
