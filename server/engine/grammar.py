"""Constrained decoding with llguidance: a grammar (JSON Schema, Lark, GBNF) compiled once per
content, and one matcher per constrained sequence that says, token by token, which tokens may
come next.

- ``build_tokenizer(vocab)``: llguidance's view of the model's vocabulary, made once per model
  (it tokenizes through llama.cpp itself);
- ``GrammarCache.build(kind, source)``: a ``Grammar``, or ``GrammarError`` with llguidance's
  own message or the bound it passes (``grammar_limits``); blocking, and only for a thread with
  a large stack (``compiler.GrammarCompiler`` runs it); compiled grammars are kept by scope and
  content (``get``, ``put``);
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

import ffi
from ffi.vocab import ATTR_CONTROL, ATTR_USER_DEFINED
from server.engine.grammar_limits import TooComplex, check_gbnf, check_lark, check_schema_text, parser_limits

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions

# llguidance itself (and our GBNF reader over it) is imported by the first grammar's build, in
# its thread: a server that is never asked for a grammar does not load it (about 6 ms of start).

GrammarKind = Literal["json_schema", "lark", "gbnf"]

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
# A key of the cache: (scope, kind, source). A grammar is reused only within its scope (an API
# key's tenant and a cache salt, as prefixes are): a hit answers faster than a compile, which
# would tell a client what another scope asked for.
CacheKey = tuple[str, GrammarKind, str]


class GrammarError(ValueError):
    """The grammar cannot be compiled; the message is llguidance's."""


def build_tokenizer(vocab: ffi.Vocab, eog_tokens: frozenset[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for ``vocab``, whose end-of-generation tokens end a grammar.
    Blocking (one pass over the vocabulary, about a second for 50k tokens)."""
    import llguidance

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
    """Compiles grammars for one tokenizer and keeps the last ``size`` by scope and content.
    Thread-safe: ``build`` runs in compile threads."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, size: int = GRAMMAR_CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self._size = size
        self._grammars: collections.OrderedDict[CacheKey, Grammar] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: CacheKey) -> Grammar | None:
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
            return grammar

    def put(self, key: CacheKey, grammar: Grammar) -> None:
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > self._size:
                self._grammars.popitem(last=False)

    def _one_token(self, text: str) -> int | None:
        """The one token ``text`` is (control tokens read as such), or None."""
        tokens = self._tokenizer.tokenize_str(text, parse_special=True)
        return tokens[0] if len(tokens) == 1 else None

    def build(self, kind: GrammarKind, source: str) -> Grammar:
        """Blocking: the grammar for ``source`` (a JSON Schema as JSON text, a Lark grammar, or
        a GBNF grammar), checked against ``grammar_limits`` first, and its first steps taken on
        a copy, so that a grammar that fails there fails now. Raises ``GrammarError``.

        llguidance recurses as deep as the grammar's chains: call this only in a thread whose
        stack is ``grammar_limits.COMPILE_STACK_BYTES``."""
        import llguidance

        from server.engine import gbnf

        # Lark made from GBNF: llguidance's messages quote it, and the client never wrote it.
        translated = False
        try:
            if kind == "json_schema":
                check_schema_text(source)
                text = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
            else:
                if kind == "gbnf":
                    check_gbnf(source)
                    lark = gbnf.to_lark(source, self._one_token)
                    translated, source = lark is not source, lark
                check_lark(source)
                text = llguidance.LLMatcher.grammar_from_lark(source)
        except (gbnf.GbnfError, TooComplex) as exc:
            raise GrammarError(str(exc)) from None
        except (ValueError, RuntimeError, TypeError) as exc:
            raise GrammarError(gbnf.lark_error(str(exc)) if translated else str(exc)) from None
        matcher = llguidance.LLMatcher(self._tokenizer, text, log_level=0, limits=parser_limits())
        if matcher.is_error():
            error = matcher.get_error()
            raise GrammarError(gbnf.lark_error(error) if translated else error)
        _first_steps(matcher.deep_copy())
        return Grammar(kind, matcher)


def _first_steps(probe: llguidance.LLMatcher) -> None:
    """Compute the first mask, and the one after the tokens the grammar forces (an object's
    ``{"name": ``): where a grammar too large for a step (``Current row has 32011 items``)
    fails, it fails here, as a ``GrammarError``, rather than in the middle of an answer."""
    probe.compute_bitmask()
    forced = probe.compute_ff_tokens() if not probe.is_error() else []
    if forced:
        probe.consume_tokens(forced)
        probe.compute_bitmask()
    if probe.is_error():
        raise GrammarError(probe.get_error())
