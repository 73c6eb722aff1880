"""llama-server's ``/tokenize`` and ``/detokenize`` answers: text (or token ids and text mixed)
as token ids, with their pieces when asked, and token ids as text. Their fields are
llama-server's (and ``model``); another is refused. Tokenizing, and making the answer, run off
the event loop when large: a body of megabytes (millions of ids) never holds it. Problems are
``NativeError``s (the route answers them in llama-server's shape)."""

from __future__ import annotations

from typing import Any

from quart import Response

import ffi
from server.api.native_prompt import mixed, text_work
from server.api.native_schema import NativeError
from server.api.preflight import tokenizing
from server.api.respond import large_json_response

# Each route's fields (``native_schema.refuse_unknown`` refuses others before the model is leased).
TOKENIZE_FIELDS = frozenset({"content", "add_special", "parse_special", "with_pieces", "model"})
DETOKENIZE_FIELDS = frozenset({"tokens", "model"})
# What a token's piece and its part of the answer cost, in characters of text to tokenize
# (``off_loop``'s unit): about 11 us a token here, some 15 characters' worth.
PIECE_CHARS = 16
# What an id costs /detokenize (checked, then written out as text), in the same unit.
DETOKENIZE_CHARS = 4


async def tokenize_answer(vocab: ffi.Vocab, body: dict[str, Any]) -> Response:
    """The tokens of ``content``: text, or token ids and text mixed (llama-server's
    ``tokenize_mixed``: BOS only with ``add_special`` and text first); ``with_pieces``: each
    with its piece.

    *Cancellation*: work in a worker thread is waited for (``off_loop``).
    """
    content = body.get("content", "")
    add_special, parse_special = body.get("add_special", False), body.get("parse_special", True)
    with_pieces = body.get("with_pieces", False)
    if not all(isinstance(v, bool) for v in (add_special, parse_special, with_pieces)):
        raise NativeError("add_special, parse_special and with_pieces are true or false")
    if not isinstance(content, str | list):
        raise NativeError("content must be a string (or token ids and strings)", "content")

    def run() -> dict[str, Any]:
        if isinstance(content, str):
            tokens = vocab.tokenize(content, add_special=add_special, parse_special=parse_special)
        else:
            tokens = mixed(content, vocab, "content", add_special=add_special, parse_special=parse_special)
        return {"tokens": [_piece(vocab, t) for t in tokens] if with_pieces else tokens}

    # A text gives at most about one token a character; ids, one each.
    with tokenizing("content"):
        return await large_json_response(text_work(content) * (PIECE_CHARS if with_pieces else 1), run)


def _piece(vocab: ffi.Vocab, token: int) -> dict[str, Any]:
    """A token with its piece: its text, or its bytes when they are no whole UTF-8."""
    data = vocab.token_bytes(token)
    try:
        return {"id": token, "piece": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {"id": token, "piece": list(data)}


async def detokenize_answer(vocab: ffi.Vocab, body: dict[str, Any]) -> Response:
    """The text of ``tokens``, special tokens written as their text.

    *Cancellation*: as ``tokenize_answer``.
    """
    tokens = body.get("tokens", [])
    problem = NativeError(f"tokens must be a list of token ids (0 to {vocab.n_tokens - 1})", "tokens")
    if not isinstance(tokens, list):
        raise problem

    def run() -> dict[str, str]:
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab.n_tokens for t in tokens):
            raise problem
        return {"content": vocab.detokenize(tokens, special=True)}

    return await large_json_response(len(tokens) * DETOKENIZE_CHARS, run)
