"""Constrained decoding with llguidance: a grammar (JSON Schema, Lark, GBNF) compiled once per
content, and one matcher per constrained sequence that says, token by token, which tokens may
come next.

- ``build_tokenizer(vocab)``: llguidance's view of the model's vocabulary, made once per model
  (it tokenizes through llama.cpp itself);
- ``GrammarCache.compile(kind, source)``: a ``Grammar`` (blocking: run it in a worker thread),
  or ``GrammarError`` with llguidance's own message; compiled grammars are kept by content;
- ``Grammar.matcher()``: a fresh matcher in the grammar's start state (a cheap copy).

In the engine a constrained sequence's step is: the matcher writes its mask of allowed tokens
(``Matcher.fill_mask``), the sampler applies it to the sequence's logits row, the sampled token
is fed back (``Matcher.consume``), then the tokens the grammar now forces (``Matcher.forced``:
the text allows one continuation only) go with it into the next decode, and the grammar
reaching its end finishes the job. Unconstrained sequences never touch any of this.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import llguidance

import ffi
from ffi.vocab import ATTR_CONTROL, ATTR_USER_DEFINED

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

GrammarKind = Literal["json_schema", "lark", "gbnf"]

# Resource bounds of one grammar, so that no schema can make compilation or a mask step take
# unbounded time or memory (llguidance's own units; its defaults are 1,000,000 / 200,000 /
# 50,000 / 250,000 / 500,000). Past them a compile is a GrammarError (400), a step an error.
LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=100_000,
    max_grammar_size=200_000,
    verbose_errors=False,  # messages go back to clients: no grammar dumps
)
# JSON output on one line, ", " and ": " between items, no other whitespace: a schema's output
# is then one text for the model to follow, and whitespace cannot pad it up to max_tokens. A
# schema may still choose otherwise with llguidance's "x-guidance" options.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# Compiled grammars kept for reuse, least recently used out.
GRAMMAR_CACHE_SIZE = 64


class GrammarError(ValueError):
    """The grammar cannot be compiled; the message is llguidance's."""


def build_tokenizer(vocab: ffi.Vocab, eog_tokens: frozenset[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for ``vocab``, whose end-of-generation tokens end a grammar.
    Blocking (one pass over the vocabulary, about a second for 50k tokens)."""
    tokens: list[bytes] = []
    for token in range(vocab.n_tokens):
        data = vocab.token_bytes(token)
        attr = vocab.attr(token)
        # llguidance marks special tokens with a leading 0xff byte, so that no text can spell
        # them (as llama.cpp's own llguidance glue does).
        if attr & ATTR_CONTROL or (attr & ATTR_USER_DEFINED and data.startswith(b"<") and data.endswith(b">")):
            data = b"\xff" + data
        tokens.append(data)
    vocab_address, tokenize_address = vocab.native_tokenizer()
    return llguidance.LLTokenizer.from_llamacpp(  # type: ignore[attr-defined]
        tokens=tokens,
        vocab_ptr=vocab_address,
        tokenize_fptr=tokenize_address,
        eos_token=sorted(eog_tokens),
        slices=llguidance.LLTokenizer.json_slices(),
    )


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar; ``matcher()`` gives each sequence its own state."""

    kind: GrammarKind
    _start: llguidance.LLMatcher

    def matcher(self) -> Matcher:
        return Matcher(self._start.deep_copy())


class Matcher:
    """One sequence's position in its grammar. Used only by the engine: the decode thread
    fills masks and consumes tokens while the engine task waits for it."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_mask(self, mask: ffi.TokenMask) -> None:
        """Write the tokens allowed next into ``mask`` (drops the GIL while it computes)."""
        self._matcher.unsafe_compute_mask_ptr(mask.address, mask.nbytes)

    def consume(self, token: int) -> None:
        """Advance past ``token``; raises ``GrammarError`` when the grammar cannot (a token
        outside the mask, or a resource limit reached)."""
        if not self._matcher.consume_token(token) or self._matcher.is_error():
            raise GrammarError(self._matcher.get_error() or f"token {token} does not fit the grammar")

    def forced(self, limit: int) -> list[int]:
        """At most ``limit`` tokens the grammar forces next (its only possible text, tokenized
        as the tokenizer would; empty when the next text is a choice). Not consumed."""
        if limit <= 0:
            return []
        return self._matcher.compute_ff_tokens()[:limit]

    def consume_run(self, tokens: list[int]) -> None:
        """Advance past ``tokens`` (a forced run); raises ``GrammarError`` as ``consume`` does."""
        if not self._matcher.consume_tokens(tokens) or self._matcher.is_error():
            raise GrammarError(self._matcher.get_error() or "a forced run does not fit the grammar")

    @property
    def done(self) -> bool:
        """The grammar has reached its end: nothing more may be generated."""
        return bool(self._matcher.is_stopped())


class GrammarCache:
    """Compiles grammars for one tokenizer, keeping the last ``size`` by content. Thread-safe:
    compiles run in worker threads."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, size: int = GRAMMAR_CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self._size = size
        self._grammars: collections.OrderedDict[tuple[str, str], Grammar] = collections.OrderedDict()
        self._lock = threading.Lock()

    def compile(self, kind: GrammarKind, source: str) -> Grammar:
        """Blocking: the grammar for ``source`` (a JSON Schema as JSON text, a Lark grammar, or
        a GBNF grammar). Raises ``GrammarError``."""
        key = (kind, source)
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                return grammar
        grammar = Grammar(kind, self._build(kind, source))
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > self._size:
                self._grammars.popitem(last=False)
        return grammar

    def _build(self, kind: GrammarKind, source: str) -> llguidance.LLMatcher:
        try:
            if kind == "json_schema":
                text = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
            elif kind == "gbnf":
                text = llguidance.grammar_from("gbnf", source)
            else:
                text = llguidance.LLMatcher.grammar_from_lark(source)
        except (ValueError, RuntimeError, TypeError) as exc:
            raise GrammarError(str(exc)) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self._tokenizer, limits=LIMITS)
        if is_error:
            raise GrammarError(messages[0] if messages else "invalid grammar")
        matcher = llguidance.LLMatcher(self._tokenizer, text, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher
