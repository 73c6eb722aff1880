"""Log-probabilities in OpenAI's two shapes: chat's ``{"content": [{"token", "logprob",
"bytes", "top_logprobs"}]}`` and legacy completions' ``{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}``. Pure: a token's bytes come from the function given.

A log-probability of -inf (a token a grammar forbade) is written as -9999.0, as OpenAI writes
impossible ones; JSON has no infinity. Such alternatives are left out of the top lists.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from server.engine import TokenLogprob

TokenBytes = Callable[[int], bytes]
IMPOSSIBLE = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else IMPOSSIBLE


def _entry(token: int, logprob: float, token_bytes: TokenBytes) -> dict[str, Any]:
    data = token_bytes(token)
    return {"token": data.decode("utf-8", "replace"), "logprob": _finite(logprob), "bytes": list(data)}


def chat_content(logprobs: Sequence[TokenLogprob], token_bytes: TokenBytes) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` entries for these tokens."""
    out = []
    for item in logprobs:
        entry = _entry(item.token, item.logprob, token_bytes)
        entry["top_logprobs"] = [_entry(t, lp, token_bytes) for t, lp in item.top if math.isfinite(lp)]
        out.append(entry)
    return out


class CompletionLogprobs:
    """Legacy completions' ``logprobs`` for the tokens of one answer, piece by piece;
    ``text_offset`` counts characters from the start of the answer's text."""

    def __init__(self, token_bytes: TokenBytes) -> None:
        self._token_bytes = token_bytes
        self._offset = 0

    def payload(self, logprobs: Sequence[TokenLogprob], text: str) -> dict[str, Any]:
        """The logprobs of ``logprobs``' tokens, which brought ``text`` (their offsets start
        where the last call's text ended; a piece of several tokens, such as a run a grammar
        forced, gives each the offset its own text starts at, within ``text``)."""
        tokens, offsets = [], []
        within = 0
        for item in logprobs:
            token = self._token_bytes(item.token).decode("utf-8", "replace")
            tokens.append(token)
            offsets.append(self._offset + min(within, len(text)))
            within += len(token)
        self._offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(item.logprob) for item in logprobs],
            "top_logprobs": [
                {self._token_bytes(t).decode("utf-8", "replace"): lp for t, lp in item.top if math.isfinite(lp)}
                for item in logprobs
            ],
            "text_offset": offsets,
        }


def completion_whole(pieces: Sequence[tuple[Sequence[TokenLogprob], str]], token_bytes: TokenBytes) -> dict[str, Any]:
    """Legacy completions' ``logprobs`` of a whole answer, from its pieces (logprobs, text)."""
    reader = CompletionLogprobs(token_bytes)
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for items, text in pieces:
        for key, values in reader.payload(items, text).items():
            merged[key] += values
    return merged
