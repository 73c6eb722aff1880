"""The native family's prompts: llama-server's ``prompt`` (text, token ids, both mixed in one
sequence, ``prompt_string``, or a list of those) as token lists, and how much text a body's
parse tokenizes (``parse_work``: the estimate that moves a parse off the event loop)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from server.api import native_schema
from server.api.lazy import deferred
from server.api.preflight import INLINE_WORK_CHARS
from server.api.prompt import text_tokens

if TYPE_CHECKING:
    from server.api import schema
else:  # imported once the server is ready (server.api.lazy)
    schema = deferred("server.api.schema")


# What one call of the tokenizer costs besides its text, in characters of text (about 50 us a
# call here, some 80 characters' worth; ``preflight.INLINE_WORK_CHARS``).
TOKENIZE_CALL_CHARS = 64


def parse_work(body: dict[str, Any], *, infill: bool) -> int:
    """How much text parsing ``body`` tokenizes, in characters (``off_loop``'s estimate): the
    prompt, the texts of ``logit_bias`` and /infill's prefix, suffix and extra files (each text
    a tokenizer call). The walk stops once past ``INLINE_WORK_CHARS`` (all ``off_loop`` asks),
    so it stays short whatever the body holds."""
    work = text_work(body.get("prompt", ""))
    for text in _parsed_texts(body, infill=infill):
        if work > INLINE_WORK_CHARS:
            break
        work += len(text) + TOKENIZE_CALL_CHARS
    return work


def text_work(value: Any) -> int:
    """How much text ``value`` (a prompt or a ``content``: text, token ids, lists or objects of
    those) is to tokenize, in characters (``off_loop``'s estimate): each text its length and a
    tokenizer call, each id or other item one character's worth. The walk stops once past
    ``INLINE_WORK_CHARS``: a list of millions of ids is not walked (nor written out) on the
    event loop to find that it is large."""
    if isinstance(value, str):
        return len(value)
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    work = 0
    for item in items:
        if work > INLINE_WORK_CHARS:
            break
        work += text_work(item) + (TOKENIZE_CALL_CHARS if isinstance(item, str) else 1)
    return work


def _parsed_texts(body: dict[str, Any], *, infill: bool) -> Iterator[str]:
    """The texts besides the prompt that parsing ``body`` tokenizes, one per tokenizer call, up
    to the first entry the parse refuses."""
    if infill:
        for name in ("input_prefix", "input_suffix"):
            value = body.get(name)
            if isinstance(value, str):
                yield value
        extra = body.get("input_extra")
        for chunk in extra if isinstance(extra, list) else ():
            if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
                break  # refused there
            filename = chunk.get("filename")
            yield filename if isinstance(filename, str) else ""  # its name, or the separator
            yield chunk["text"]
    bias = body.get("logit_bias")
    entries = bias.keys() if isinstance(bias, dict) else bias if isinstance(bias, list) else ()
    for entry in itertools.islice(entries, schema.MAX_LOGIT_BIAS + 1):  # more: refused first
        text = entry[0] if isinstance(entry, list) and entry else entry
        if isinstance(text, str):
            yield text


def native_prompts(value: Any, vocab: native_schema.Tokenizer) -> list[list[int]]:
    """llama-server's ``prompt``: a string, token ids, one sequence mixing both, an object with
    ``prompt_string``, or a list of those (one answer each), as token lists. Blocking."""
    if value is None:
        raise native_schema.NativeError('"prompt" is required', "prompt")
    if isinstance(value, list) and value and all(isinstance(p, int | str) for p in value):
        if any(isinstance(p, int) and not isinstance(p, bool) for p in value):
            return [mixed(value, vocab)]
    if isinstance(value, list):
        if not value or len(value) > schema.MAX_PROMPTS:
            raise native_schema.NativeError(f"prompt must hold 1 to {schema.MAX_PROMPTS} prompts", "prompt")
        return [_one(p, vocab, f"prompt[{i}]") for i, p in enumerate(value)]
    return [_one(value, vocab, "prompt")]


def _one(value: Any, vocab: native_schema.Tokenizer, where: str) -> list[int]:
    if isinstance(value, str):
        return text_tokens(vocab, value)  # type: ignore[arg-type]
    if isinstance(value, list) and all(isinstance(p, int | str) and not isinstance(p, bool) for p in value):
        return mixed(value, vocab)
    if isinstance(value, dict) and isinstance(value.get("prompt_string"), str):
        if value.get("multimodal_data"):
            raise native_schema.NativeError("this server takes no images or audio (multimodal_data)", where)
        return text_tokens(vocab, value["prompt_string"])  # type: ignore[arg-type]
    raise native_schema.NativeError("a prompt is a string, token ids, or {'prompt_string': ...}", where)


def mixed(
    value: list[Any],
    vocab: native_schema.Tokenizer,
    param: str = "prompt",
    *,
    add_special: bool = True,
    parse_special: bool = True,
) -> list[int]:
    """Token ids and text in one sequence, as llama-server's ``tokenize_mixed``: the text
    parsed for special tokens when ``parse_special``; the model's special tokens (BOS) only
    when ``add_special`` and the sequence starts with text, never for an empty one. Anything
    else in it (a float, a bool, null, a list, an object) or an id outside the vocabulary is a
    ``NativeError`` naming ``param``."""
    tokens: list[int] = []
    for i, part in enumerate(value):
        if isinstance(part, str):
            tokens += vocab.tokenize(part, add_special=add_special and i == 0, parse_special=parse_special)
        elif isinstance(part, bool) or not isinstance(part, int):
            raise native_schema.NativeError(f"{param} holds token ids and strings only, not {part!r:.40}", param)
        elif not 0 <= part < vocab.n_tokens:
            raise native_schema.NativeError(f"token {part} is not in the vocabulary ({vocab.n_tokens} tokens)", param)
        else:
            tokens.append(part)
    return tokens
