"""Log-probabilities in OpenAI's two shapes: chat's ``{"content": [{"token", "logprob",
"bytes", "top_logprobs"}]}`` and legacy completions' ``{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}``. Pure: tokens' bytes and names come from the vocabulary given.

A log-probability of -inf (a token a grammar forbade) is written as -9999.0, as OpenAI writes
impossible ones; JSON has no infinity. Such alternatives are left out of the top lists.

Legacy ``top_logprobs`` are objects keyed by token, so distinct tokens need distinct keys
(``legacy_name``): a token's text when its bytes are UTF-8; ``bytes:`` and the bytes as
``\\xNN`` escapes when they are not (part of a character, as OpenAI's legacy API writes them);
a control token (no text of its own) as the vocabulary spells it; and ``token:<id>`` for a
token whose name another token in the same object already has. ``tokens`` uses the same names,
so ``top_logprobs[i][tokens[i]]`` is the chosen token's entry. ``text_offset`` is each token's
own place in the answer's text: the characters its tokens before it completed.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Sequence
from typing import Any, Protocol

from server.engine import TokenLogprob

IMPOSSIBLE = -9999.0


class Vocabulary(Protocol):
    def piece(self, token: int) -> bytes:
        """The bytes a token stands for in generated text (b"" for a control token)."""
        ...

    def text(self, token: int) -> str:
        """The token as the vocabulary spells it."""
        ...


def _finite(value: float) -> float:
    return value if math.isfinite(value) else IMPOSSIBLE


def _entry(token: int, logprob: float, vocab: Vocabulary) -> dict[str, Any]:
    data = vocab.piece(token)
    return {"token": data.decode("utf-8", "replace"), "logprob": _finite(logprob), "bytes": list(data)}


def chat_content(logprobs: Sequence[TokenLogprob], vocab: Vocabulary) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` entries for these tokens."""
    out = []
    for item in logprobs:
        entry = _entry(item.token, item.logprob, vocab)
        entry["top_logprobs"] = [_entry(t, lp, vocab) for t, lp in item.top if math.isfinite(lp)]
        out.append(entry)
    return out


def legacy_name(token: int, vocab: Vocabulary) -> str:
    """A token's name in legacy completions' logprobs (see the module's docstring)."""
    data = vocab.piece(token)
    if not data:
        return vocab.text(token)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)


def _legacy_top(item: TokenLogprob, vocab: Vocabulary) -> dict[str, float]:
    """One token's alternatives by name; the chosen token's name is its own even when it is not
    among them."""
    taken = {legacy_name(item.token, vocab): item.token}
    top: dict[str, float] = {}
    for token, logprob in item.top:
        if not math.isfinite(logprob):
            continue
        name = legacy_name(token, vocab)
        if taken.setdefault(name, token) != token:
            name = f"token:{token}"
        top[name] = logprob
    return top


class CompletionLogprobs:
    """Legacy completions' ``logprobs`` for the tokens of one answer, piece by piece."""

    def __init__(self, vocab: Vocabulary) -> None:
        self._vocab = vocab
        self._offset = 0  # characters of the answer that its tokens so far completed
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")  # as the engine's detokenizer

    def payload(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        """The logprobs of these tokens, the next ones of the answer."""
        offsets = []
        for item in logprobs:
            offsets.append(self._offset)
            self._offset += len(self._decoder.decode(self._vocab.piece(item.token)))
        return {
            "tokens": [legacy_name(item.token, self._vocab) for item in logprobs],
            "token_logprobs": [_finite(item.logprob) for item in logprobs],
            "top_logprobs": [_legacy_top(item, self._vocab) for item in logprobs],
            "text_offset": offsets,
        }


def completion_whole(logprobs: Sequence[TokenLogprob], vocab: Vocabulary) -> dict[str, Any]:
    """Legacy completions' ``logprobs`` of a whole answer."""
    return CompletionLogprobs(vocab).payload(logprobs)
