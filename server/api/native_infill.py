"""``/infill``'s prompt: fill-in-the-middle with the model's own FIM tokens, in the
repository-level layout llama-server uses (after Qwen2.5-Coder's report, arXiv 2409.12186):

    [REP]myproject\\n [SEP]name\\n text ... [SEP]filename\\n [BOS] [PRE] prefix prompt [SUF] suffix [MID]

(a model without a repository or file-separator token gets the extra files between plain
``--- snippet ---`` lines instead). Prefix and suffix are cut to fit a batch, the prefix keeping
its end and the suffix its start (3:1); the extra files fill what the context has left. Pure:
the tokenizer is given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from server.api.native_schema import NativeError

Tokenize = Callable[[str], list[int]]  # text to tokens, no special tokens added or parsed
PROJECT = "myproject\n"  # llama-server's fixed repository name
CURRENT_FILE = "filename\n"
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"
# The fields of /infill's body read here (into its prompt); the rest is /completion's.
INFILL_FIELDS = frozenset({"input_prefix", "input_suffix", "input_extra"})


@dataclass(frozen=True)
class Fim:
    """A model's fill-in-the-middle tokens (``ffi.Vocab.fim``, ``fim_rep``, ``fim_sep``)."""

    prefix: int
    suffix: int
    middle: int
    repository: int | None
    separator: int | None
    bos: int | None  # when the model wants one first


@dataclass(frozen=True)
class Extra:
    filename: str
    text: str


def extra_chunks(value: Any) -> list[Extra]:
    """``input_extra``: a list of ``{"text": str, "filename": str}`` (filename optional)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise NativeError('input_extra must be a list of {"filename": string, "text": string}', "input_extra")
    chunks = []
    for i, chunk in enumerate(value):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise NativeError('each input_extra entry needs a "text" string', f"input_extra[{i}].text")
        filename = chunk.get("filename", "tmp")
        if not isinstance(filename, str):
            raise NativeError("an input_extra filename must be a string", f"input_extra[{i}].filename")
        chunks.append(Extra(filename, chunk["text"]))
    return chunks


def infill_tokens(
    fim: Fim,
    tokenize: Tokenize,
    *,
    prefix: str,
    suffix: str,
    prompt: str,
    extra: Sequence[Extra],
    n_batch: int,
    room: int,
) -> list[int]:
    """The FIM prompt's tokens. ``room``: how many tokens of the context the extra files may
    take at most (the context less a batch and twice the answer's budget, as there)."""
    prompt_tokens = tokenize(prompt) if prompt else []
    prefix_tokens = tokenize(prefix) if prefix else []
    suffix_tokens = tokenize(suffix) if suffix else []
    prefix_take = min(len(prefix_tokens), 3 * (n_batch // 4))
    suffix_take = min(len(suffix_tokens), max(0, n_batch // 4 - (2 + len(prompt_tokens))))
    head = [fim.prefix, *prefix_tokens[len(prefix_tokens) - prefix_take :], *prompt_tokens]
    tail = [fim.suffix, *suffix_tokens[:suffix_take]]
    extras = _extra_tokens(fim, tokenize, extra)
    extras = extras[len(extras) - min(max(0, room), len(extras)) :]
    bos = [fim.bos] if fim.bos is not None else []
    return [*extras, *bos, *head, *tail, fim.middle]


def _extra_tokens(fim: Fim, tokenize: Tokenize, extra: Sequence[Extra]) -> list[int]:
    out: list[int] = []
    if fim.repository is not None:
        out += [fim.repository, *tokenize(PROJECT)]
    for chunk in extra:
        if fim.separator is not None:
            out += [fim.separator, *tokenize(chunk.filename + "\n")]
        else:
            out += tokenize(SNIPPET_SEPARATOR)
        out += tokenize(chunk.text)
    if fim.separator is not None:
        out += [fim.separator, *tokenize(CURRENT_FILE)]
    return out
