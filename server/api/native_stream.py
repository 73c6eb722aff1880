"""llama-server's own stream (``/completion`` and ``/infill`` with ``stream: true``) as a
``StreamDialect``: one ``data: {...}`` object per piece (its text, its tokens, counts so far),
then per choice a closing object with ``"stop": true``, the stop type, timings and settings;
no ``[DONE]``. An error ends the stream with a ``data: {"error": ...}`` object in llama-server's
error shape.

Every piece carries its token ids, which the engine's direct path (text only) cannot frame, so
these streams take the channel path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from server.api import native_render, sse
from server.api.errors import ApiError
from server.api.native_schema import NativeOptions
from server.api.prepare import Prepared
from server.engine import Piece, Usage

SSE_PING = b": ping\n\n"


@dataclass(frozen=True)
class StreamContext:
    """What a native stream's objects report beside the pieces."""

    model: str
    settings: native_render.Settings
    options: NativeOptions
    prompts: Sequence[str]  # each prompt's text, special tokens written out
    started: float  # time.monotonic() when the request arrived


class NativeStream:
    """The objects of one native stream for ``prepared``."""

    ping = SSE_PING

    def __init__(self, prepared: Prepared, context: StreamContext, error_body: Callable[[ApiError], dict]) -> None:
        self._prepared = prepared
        self._context = context
        self._error_body = error_body
        self._token_bytes = prepared.engine.vocab.piece
        self._detokenize = prepared.engine.vocab.detokenize
        n = prepared.job.n_choices
        self._texts: list[list[str]] = [[] for _ in range(n)]
        self._tokens: list[list[int]] = [[] for _ in range(n)]
        # The named slot ran the first choice; copies (n > 1) ran elsewhere.
        self._id_slot = native_render.NO_SLOT if prepared.job.slot is None else prepared.job.slot
        self._first: float | None = None
        self._last: float | None = None

    def _n_prompt(self, index: int) -> int:
        return len(self._prepared.job.prompts[index // self._prepared.job.n])

    def _timing(self) -> native_render.Timing:
        start = self._context.started
        first = None if self._first is None else self._first - start
        last = None if self._last is None else self._last - start
        return native_render.Timing(first, last)

    def opening(self) -> Sequence[bytes]:
        return ()

    def feed(self, piece: Piece) -> Sequence[bytes]:
        now = time.monotonic()
        self._first = self._first or now
        self._last = now
        index = piece.index
        self._texts[index].append(piece.text)
        self._tokens[index].extend(piece.tokens)
        if not piece.text and not piece.tokens:
            return ()
        options = self._context.options
        probs = native_render.probabilities(piece.logprobs, self._token_bytes) if options.n_probs else None
        timing = None
        if options.timings_per_token:
            timing = native_render.timings(None, self._timing(), len(self._tokens[index]))
            timing["prompt_n"] = self._n_prompt(index)
        payload = native_render.partial_object(
            index,
            piece.text,
            piece.tokens,
            n_generated=len(self._tokens[index]),
            n_prompt=self._n_prompt(index),
            probs=probs,
            timing=timing,
            id_slot=self._id_slot if index == 0 else native_render.NO_SLOT,
        )
        return (sse.event(payload),)

    def finish(self, piece: Piece) -> Sequence[bytes]:
        assert piece.finish_reason is not None
        index, context = piece.index, self._context
        content = "".join(self._texts[index])
        final = native_render.Final(
            index=index,
            content=content,
            tokens=self._tokens[index],
            finish=piece.finish_reason,
            usage=piece.usage,
            generated=self._detokenize(self._tokens[index]) if context.options.stop else content,
            prompt=context.prompts[index // self._prepared.job.n],
            probabilities=None,
            id_slot=self._id_slot if index == 0 else native_render.NO_SLOT,
        )
        payload = native_render.final_object(
            final,
            model=context.model,
            settings=context.settings,
            options=context.options,
            timing=self._timing(),
            stream=True,
        )
        return (sse.event(payload),)

    def closing(self, usage: Usage | None) -> Sequence[bytes]:
        return ()

    def failed(self, error: ApiError) -> Sequence[bytes]:
        return (sse.event(self._error_body(error)),)

    def direct_text(self) -> Callable[[str], bytes] | None:
        return None  # every object carries its tokens: the channel path

    def direct_written(self) -> None:
        """Never called: this dialect frames nothing directly (``direct_text`` is None)."""
