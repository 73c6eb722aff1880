"""``Vocab``: tokenization and detokenization with a model's vocabulary."""

from __future__ import annotations

import codecs
import re
from typing import TYPE_CHECKING, Any, NamedTuple

from ffi._lib import ffi, lib
from ffi.errors import ClosedError, TokenizeError

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from ffi.model import Model

_INT32_MIN = -(2**31)
# llama_token_attr bits of control tokens that eat the whitespace beside them when parsed.
_LSTRIP = 1 << 7
_RSTRIP = 1 << 8
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4


LLAMA_TOKEN_NULL = -1


def _token_or_none(token: int) -> int | None:
    return None if token == LLAMA_TOKEN_NULL else int(token)


class FimTokens(NamedTuple):
    """A model's fill-in-the-middle tokens; each None when it has none."""

    prefix: int | None
    suffix: int | None
    middle: int | None


class Vocab:
    """The vocabulary of a ``Model``; valid while the model is open.

    The llama.cpp tokenizer calls are thread-safe, so these methods may run in worker threads.
    Token pieces are cached per token id, as the generation loop asks for them once per token.
    """

    def __init__(self, model: Model, ptr: Any) -> None:
        self._model = model
        self._ptr: Any = ptr
        self.n_tokens: int = lib.llama_vocab_n_tokens(ptr)
        self.bos: int = lib.llama_vocab_bos(ptr)
        self.eos: int = lib.llama_vocab_eos(ptr)
        self.add_bos: bool = bool(lib.llama_vocab_get_add_bos(ptr))
        # Fill-in-the-middle tokens (prefix, suffix, middle, repository, file separator), each
        # None when the model has none.
        self.fim: FimTokens = FimTokens(
            *(
                _token_or_none(f(ptr))
                for f in (lib.llama_vocab_fim_pre, lib.llama_vocab_fim_suf, lib.llama_vocab_fim_mid)
            )
        )
        self.fim_rep: int | None = _token_or_none(lib.llama_vocab_fim_rep(ptr))
        self.fim_sep: int | None = _token_or_none(lib.llama_vocab_fim_sep(ptr))
        self._pieces: dict[int, bytes] = {}
        self._eog: frozenset[int] | None = None
        self._control: re.Pattern[str] | None = None
        self._controls: dict[str, tuple[int, bool, bool]] = {}

    def _detach(self) -> None:
        self._ptr = None

    @property
    def ptr(self) -> Any:
        if self._ptr is None:
            raise ClosedError("model is closed")
        return self._ptr

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Tokens of ``text``. ``add_special`` adds BOS when the model wants it;
        ``parse_special`` turns special-token text (``<|im_start|>``) into those tokens."""
        data = text.encode("utf-8")
        ptr = self.ptr
        capacity = len(data) + 2
        while True:
            out = ffi.new("llama_token[]", capacity)
            n = lib.llama_tokenize(ptr, data, len(data), out, capacity, add_special, parse_special)
            if n == _INT32_MIN:
                raise TokenizeError("text too long to tokenize")
            if n >= 0:
                return list(out[0:n])
            capacity = -n

    def piece(self, token: int) -> bytes:
        """The bytes one token stands for in generated text (control tokens give b"")."""
        cached = self._pieces.get(token)
        if cached is not None:
            return cached
        if not 0 <= token < self.n_tokens:
            raise ValueError(f"token {token} out of range")
        buf = ffi.new("char[64]")
        n = lib.llama_token_to_piece(self.ptr, token, buf, 64, 0, False)
        if n < 0:
            buf = ffi.new("char[]", -n)
            n = lib.llama_token_to_piece(self.ptr, token, buf, -n, 0, False)
        piece = ffi.unpack(buf, n)
        self._pieces[token] = piece
        return piece

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        """Text of a whole token sequence (invalid UTF-8 replaced)."""
        if not tokens:
            return ""
        arr = ffi.new("llama_token[]", list(tokens))
        capacity = len(tokens) * 8 + 16
        while True:
            buf = ffi.new("char[]", capacity)
            n = lib.llama_detokenize(self.ptr, arr, len(tokens), buf, capacity, False, special)
            if n >= 0:
                return ffi.unpack(buf, n).decode("utf-8", "replace")
            capacity = -n

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, ...)."""
        return bool(lib.llama_vocab_is_eog(self.ptr, token))

    @property
    def eog_tokens(self) -> frozenset[int]:
        """Every end-of-generation token, found once (one C pass over the vocabulary); a set
        lookup is what the generation loop does per token instead of a C call."""
        if self._eog is None:
            self._eog = frozenset(self._select(0))
        return self._eog

    def _select(self, attr_mask: int) -> list[int]:
        """The tokens with an attribute in ``attr_mask`` (0: the end-of-generation tokens)."""
        out = ffi.new("int32_t[]", self.n_tokens)
        count = lib.llama_trio_vocab_select(self.ptr, self.n_tokens, attr_mask, out)
        return ffi.unpack(out, count)

    @property
    def control_pattern(self) -> re.Pattern[str]:
        """A regex that finds the text of any token that ``tokenize(..., parse_special=True)``
        turns into a control token and ``parse_special=False`` would not (llama.cpp's CONTROL
        and UNKNOWN tokens, e.g. ``<|im_start|>``), longest first; see ``control_tokens``."""
        if self._control is None:
            self._find_controls()
        assert self._control is not None
        return self._control

    @property
    def control_tokens(self) -> dict[str, tuple[int, bool, bool]]:
        """Control-token text -> (token, strips whitespace on its left, on its right)."""
        if self._control is None:
            self._find_controls()
        return self._controls

    def _find_controls(self) -> None:
        # Once per vocabulary: one C pass finds them, then one C call per control token.
        ptr = self.ptr
        controls: dict[str, tuple[int, bool, bool]] = {}
        for token in self._select(lib.LLAMA_TOKEN_ATTR_CONTROL | lib.LLAMA_TOKEN_ATTR_UNKNOWN):
            attr = lib.llama_vocab_get_attr(ptr, token)
            text = self.text(token)
            if text and text not in controls:
                controls[text] = (token, bool(attr & _LSTRIP), bool(attr & _RSTRIP))
        # Longest first, so that a text that begins another one never hides it.
        alternatives = "|".join(re.escape(t) for t in sorted(controls, key=len, reverse=True))
        self._controls = controls
        self._control = re.compile(alternatives or r"(?!)")

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token as written with special tokens rendered (``<|im_end|>``
        gives its text), for tools that need the whole vocabulary (a grammar engine)."""
        buf = ffi.new("char[256]")
        n = lib.llama_token_to_piece(self.ptr, token, buf, 256, 0, True)
        if n < 0:
            buf = ffi.new("char[]", -n)
            n = lib.llama_token_to_piece(self.ptr, token, buf, -n, 0, True)
        return ffi.unpack(buf, n)

    def attr(self, token: int) -> int:
        """llama.cpp's ``llama_token_attr`` bits of a token."""
        return int(lib.llama_vocab_get_attr(self.ptr, token))

    def native_tokenizer(self) -> tuple[int, int]:
        """(address of this vocabulary, address of ``llama_tokenize``): for a native library
        that tokenizes through llama.cpp itself (llguidance). Valid while the model is open."""
        return int(ffi.cast("uintptr_t", self.ptr)), int(ffi.cast("uintptr_t", ffi.addressof(lib, "llama_tokenize")))

    def is_control(self, token: int) -> bool:
        return bool(lib.llama_vocab_is_control(self.ptr, token))

    def text(self, token: int) -> str:
        """The vocabulary entry of a token (its raw text, as stored in the GGUF)."""
        return ffi.string(lib.llama_vocab_get_text(self.ptr, token)).decode("utf-8", "replace")


class Detokenizer:
    """Turns generated tokens into text one token at a time, never splitting a character.

    Bytes of a multi-byte UTF-8 character that arrive across several tokens are held until the
    character is complete, then emitted once; bytes that can never form valid UTF-8 become
    U+FFFD. ``flush()`` releases whatever is held at the end of generation.
    """

    __slots__ = ("_piece", "_decoder")

    def __init__(self, vocab: Vocab) -> None:
        self._piece = vocab.piece
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token: int) -> str:
        return self._decoder.decode(self._piece(token))

    def feed_bytes(self, data: bytes) -> str:
        return self._decoder.decode(data)

    def feed_all(self, tokens: Iterable[int]) -> str:
        return "".join(self.feed(t) for t in tokens)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
