"""``Embedder``: pooled, normalised (L2 by default) embeddings from a second llama.cpp context on the same
model, made with ``embeddings`` on. Knows no HTTP.

    async with open_embedder(model, n_ctx=..., n_batch=..., n_seq_max=..., n_threads=...) as embedder:
        vectors = await embedder.embed([[1, 2, 3], [4, 5]])

Inputs are packed into as few decodes as fit (at most ``n_batch`` tokens and ``n_seq_max``
sequences each); each decode runs in the embedder's own decode thread, and the sequences are
cleared after it. One request's inputs run at a time (a lock): embeddings never wait behind the
generation engine, and share the CPU with it. A drain ends them as the engine's jobs:
``fail_waiting`` those still waiting for their turn, ``abort_all`` at its deadline.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Sequence

import trio

import ffi
from server.engine.config import EmbedderStats
from server.engine.decode_thread import DecodeThread
from server.engine.jobs import EngineError


class _Call:
    """One ``embed`` call: its cancel scope, whether it has its turn, and the error that ends
    it when the embedder does."""

    __slots__ = ("error", "running", "scope")

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.running = False
        self.error: EngineError | None = None


class Embedder:
    """Owns an embeddings context and the thread that decodes with it; ``close()`` frees both
    (idempotent)."""

    def __init__(self, context: ffi.Context, thread: DecodeThread) -> None:
        self._context = context
        self._thread = thread
        self._batch = ffi.Batch(context.n_batch)
        self._lock = trio.Lock()
        self.max_tokens = min(context.n_ctx_seq, context.n_batch)  # per input
        self.pooling = context.pooling
        self._closed = False
        self._calls: set[_Call] = set()
        self._refusal: EngineError | None = None  # after ``abort_all``: every call ends with it
        self.stats = EmbedderStats()

    async def embed(self, inputs: Sequence[Sequence[int]], norm: int = 2) -> list[list[float]]:
        """One vector per input (each 1 to ``max_tokens`` tokens), in order, normalised by
        ``norm`` (``normalized``: a unit vector by default). Raises the ``EngineError`` of
        ``fail_waiting`` or ``abort_all`` when they end it.

        *Cancellation*: a decode in progress stops part-way (``Context.interrupt``) and is
        waited for (never abandoned); the sequences are cleared either way.
        """
        if self._refusal is not None:
            raise self._refusal
        call = _Call()
        self._calls.add(call)
        self.stats.requests += 1
        out: list[list[float]] = []
        try:
            with call.scope:
                async with self._lock:
                    call.running = True
                    for group in _pack(inputs, self._context.n_batch, self._context.n_seq_max):
                        self._context.resume()
                        out += await self._thread.run(self._decode, group, norm, stop=self._context.interrupt)
                        self.stats.inputs += len(group)
                return out
        finally:
            self._calls.discard(call)
            self.stats.requests -= 1
            if len(out) < len(inputs):
                self.stats.ended_early += 1
        assert call.error is not None  # only ours cancel its scope
        raise call.error

    def fail_waiting(self, error: EngineError) -> None:
        """End the calls still waiting for their turn with ``error`` now."""
        for call in self._calls:
            if not call.running:
                call.error = error
                call.scope.cancel()

    def abort_all(self, error: EngineError) -> None:
        """End every call with ``error``, running ones once their decode in progress has
        stopped (part-way); later calls too."""
        self._refusal = error
        for call in self._calls:
            call.error = error
            call.scope.cancel()

    async def idle(self) -> None:
        """Return once no call has the embedder (after ``abort_all``: once the decode in
        progress, which is never abandoned, has stopped).

        *Cancellation*: safe at any point.
        """
        async with self._lock:
            pass

    def _decode(self, group: Sequence[Sequence[int]], norm: int) -> list[list[float]]:
        """In the decode thread: one decode of ``group``, one sequence each; the vectors
        normalised by ``norm``."""
        batch, context = self._batch, self._context
        batch.clear()
        try:
            for seq_id, tokens in enumerate(group):
                batch.add_run(tokens, 0, seq_id, logits_last=True, all_outputs=True)  # pooled: every token
            try:
                context.decode(batch)
            except ffi.DecodeAbortedError:  # its caller was cancelled (``embed``) and hears nothing of it
                self.stats.interrupted += 1
                raise
            return [normalized(context.embedding(seq_id), norm) for seq_id in range(len(group))]
        finally:
            context.clear()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._batch.close()
        self._context.close()
        self._thread.close()


def _pack(inputs: Sequence[Sequence[int]], n_batch: int, n_seq_max: int) -> list[list[Sequence[int]]]:
    """Consecutive groups of inputs that each fit one decode."""
    groups: list[list[Sequence[int]]] = []
    size = 0
    for tokens in inputs:
        if not groups or size + len(tokens) > n_batch or len(groups[-1]) == n_seq_max:
            groups.append([])
            size = 0
        groups[-1].append(tokens)
        size += len(tokens)
    return groups


def normalized(vector: list[float], norm: int = 2) -> list[float]:
    """``vector`` scaled as llama.cpp's ``embd_normalize`` says: -1 as it is, 0 its largest
    magnitude to 32760 (the int16 range), 2 to unit length, any other p > 0 to unit p-norm (1:
    taxicab). A zero vector stays zero."""
    if norm == -1:
        return vector
    if norm == 0:
        size = max((abs(v) for v in vector), default=0.0) / 32760.0
    elif norm == 2:
        size = math.sqrt(sum(v * v for v in vector))
    elif norm > 0:  # scaled by the largest magnitude first: no power overflows, the sum is at least 1
        largest = max((abs(v) for v in vector), default=0.0)
        size = largest * sum((abs(v) / largest) ** norm for v in vector) ** (1.0 / norm) if largest > 0 else 0.0
    else:
        raise ValueError(f"no normalisation {norm}")
    return [v / size for v in vector] if size > 0 else [0.0] * len(vector)


def model_pooling(model: ffi.Model) -> str:
    """The pooling a model asks for in its metadata; "mean" when it asks for none (a causal
    language model)."""
    architecture = model.meta("general.architecture") or ""
    kind = model.meta(f"{architecture}.pooling_type")
    return {"2": "cls", "3": "last"}.get(kind or "", "mean")


@contextlib.asynccontextmanager
async def open_embedder(
    model: ffi.Model,
    *,
    n_ctx: int,
    n_batch: int,
    n_seq_max: int,
    n_threads: int,
    pooling: str | None,
    attention: ffi.Attention | None = None,
) -> AsyncIterator[Embedder]:
    """An ``Embedder`` for the block, closed when it ends.

    *Cancellation*: leaving the block waits for a decode in progress, then frees everything.
    """
    thread = DecodeThread(name="llama-trio-embed")
    try:

        def create() -> Embedder:
            context = ffi.Context(
                model,
                n_ctx=n_ctx,
                n_batch=n_batch,
                n_seq_max=n_seq_max,
                n_threads=n_threads,
                embeddings=True,
                pooling=pooling or model_pooling(model),
                attention=attention or ffi.Attention(),
            )
            return Embedder(context, thread)

        embedder = await thread.run(create)
    except BaseException:
        thread.close()
        raise
    try:
        yield embedder
    finally:
        embedder.close()
