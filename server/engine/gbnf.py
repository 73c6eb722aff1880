r"""GBNF (llama.cpp's grammar format) as llguidance's Lark, in time linear in the grammar.

llguidance reads GBNF in Python (``llguidance.gbnf_to_lark``): a parser, then a pass that makes
each rule built only of text (no rule that is not itself such) a terminal, the same text as one
lexeme. That pass repeats over all rules until nothing changes, which for a chain of rules is
once per rule: 1,000 chained rules of 40 literals took 7 s here, holding the GIL. This module
keeps llguidance's parser and output (but for what follows) and does that pass once, counting for each rule how many
of the rules it refers to are not known to be terminals yet.

llguidance's reader and output differ from llama.cpp's GBNF in places (llama-grammar.cpp is the
reference); this module reads and writes those as llama.cpp means them:

- a quantifier over a group whose content is itself quantified (``("a"+)*``, ``(("a"){2})?``):
  llguidance drops the group and writes two operators in a row, which Lark refuses; here the
  group stays. Quantifiers in a row (``"a"+*``) apply in turn, as llama.cpp applies them.
- ``X{0}`` is the empty text (Lark refuses a range that ends at 0); ``{m,n}`` with ``n < m``
  is refused (llama.cpp never finishes reading it), so is ``m`` past llama.cpp's 2,000, and an
  ``n`` past 2,000 means no bound, as in llama.cpp.
- ``.`` is any character, newline included (Lark's ``/./`` is not).
- escapes: ``\uXXXX`` and ``\UXXXXXXXX`` keep their digits (llguidance strips leading zeros,
  which neither Lark nor its regexes read), ``\-``, ``\[`` and ``\]`` are read everywhere, and
  control characters written raw inside literals are escaped for Lark.
- character classes are written so that Lark's regexes read them as llama.cpp does: ``&``,
  ``~``, ``^`` and ``-`` (but where llama.cpp reads a range) are escaped, an empty range
  (``[z-a]``) matches nothing and ``[]`` is the empty text.
- rule names: one that is no Lark name (``2x``) gets a prefix, and one that meets another once
  written for Lark (``aB`` and ``a-b``, or a rule named ``start``) a number.
- llguidance's messages about the Lark made here quote it; ``lark_error`` leaves that out.
- tokens (llama.cpp's ``<[id]>``, ``<text>`` for the one token ``text`` is, ``!`` before either
  for any token but it), which llguidance's reader does not know, are llguidance's ``<[id]>``
  and ``<[^id]>``; ``<text>`` needs the model's vocabulary (``token_id``). A rule that holds a
  token is never a terminal (Lark's lexemes are text). One difference stays: llguidance reads a
  token that a token item can take as that item only, never as text, so after a repeated
  ``!<...>`` text cannot follow (``"x" !<[13]>* "."`` never ends: each "." is taken by the
  run); end such a run with a token, as llama.cpp's own example does (``!</think>* </think>``).

A text that already reads as Lark (``%llguidance`` or a ``start:`` rule, not GBNF's ``start ::=``)
is left as it is, as llguidance's own conversion does.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from llguidance import gbnf_to_lark as _gbnf

# llguidance's test for Lark, but for GBNF's own rule named start (``start ::= ...``).
_LARK = re.compile(r"(?m)^\s*(%llguidance\b|start\s*:(?!:=))")
_CAMEL = re.compile(r"([a-z])([A-Z])")
_LARK_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_MOST_REPEATS = 2000  # llama.cpp's MAX_REPETITION_THRESHOLD
# Escapes as llama.cpp reads them, each to its character; \x, \u and \U take 2, 4 and 8 digits.
_ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-"}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
# In a Lark literal: these as escapes, other control characters as \uXXXX, the rest as they are.
_IN_LITERAL = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
# In a class of Lark's regexes (Rust's regex syntax): escaped, or read as syntax ([, &&, ~~, --, ^).
_CLASS_SYNTAX = set("\\[]/&~^")
_MOST_TOKEN_ID = 0xFFFFFFFF  # llama.cpp reads a token id as a uint32


class GbnfError(ValueError):
    """The text is not a GBNF grammar llguidance can take; the message says why."""


def to_lark(text: str, token_id: Callable[[str], int | None] | None = None) -> str:
    """``text`` (GBNF, or Lark as it is) as a Lark grammar for llguidance. ``token_id``: the one
    token a text is in the model's vocabulary, control tokens read as such (None where it is
    not exactly one), for ``<text>``; without it ``<text>`` is refused. Raises ``GbnfError``."""
    if _LARK.search(text):
        return text
    try:
        rules = _Parser(token_id).parse(text)
    except _gbnf.GbnfToLarkError as exc:
        raise GbnfError(f"cannot read the GBNF grammar: {exc}") from None
    if "root" not in rules:
        raise GbnfError("the GBNF grammar has no 'root' rule")
    refers, holding = _link(rules)
    _mark_terminals(rules, refers, holding)
    _rename(rules)
    out = ["%llguidance {}\n\n"]
    multiline = True
    for rule in sorted(rules.values(), key=lambda r: r.order):
        rendered = str(rule)
        if not multiline and "\n" in rendered:
            out.append("\n")
        multiline = "\n" in rendered
        out.append(rendered + ("\n\n" if multiline else "\n"))
    return "".join(out)


def lark_error(message: str) -> str:
    """llguidance's message for a Lark grammar made from GBNF, without the Lark text it quotes
    (which the client never wrote): its lines and places go, what is wrong stays."""
    lines = [line for line in message.splitlines() if line.strip() and not _QUOTED.match(line)]
    return "the GBNF grammar was refused: " + _PLACE.sub("", " ".join(line.strip() for line in lines))


_QUOTED = re.compile(r"\s*(\d+ \|( |$)|\^\s*$)")
_PLACE = re.compile(r"(^|\b(at|in) )\d+\(\d+\):? ?")


class _Parser(_gbnf.GrammarParser):
    """llguidance's GBNF parser, reading literals, classes and quantifiers as llama.cpp does."""

    def __init__(self, token_id: Callable[[str], int | None] | None) -> None:
        super().__init__()
        self._nested = False  # inside a group: the sequence being read may span lines
        self._token_id = token_id

    def _parse_sequence(self, pos: _gbnf.Position, is_nested: bool) -> tuple[_gbnf.SequenceNode, _gbnf.Position]:
        """One alternative: its items up to ``|``, ``)`` or (outside a group) the line's end."""
        outer, self._nested = self._nested, is_nested
        items: list[_gbnf.ASTNode] = []
        try:
            while (c := pos.current()) and c not in "|)" and (is_nested or c not in "\r\n"):
                item: _gbnf.ASTNode
                if c == '"':
                    item, pos = self._parse_literal(pos)
                elif c == "[":
                    item, pos = self._parse_char_class(pos)
                elif c == "(":
                    item, pos = self._parse_group(pos, is_nested=is_nested)
                elif c == ".":
                    item, pos = _gbnf.RegexNode("."), pos.advance()
                elif c in "<!":
                    item, pos = self._parse_token(pos)
                elif self._is_word_char(c):
                    name, pos = self._parse_name(pos)
                    item = _gbnf.RuleRefNode(name)
                else:
                    break
                items.append(item)
                pos = self._skip_space(pos, allow_newlines=is_nested)
                pos = self._parse_repetition(pos, items)
                pos = self._skip_space(pos, allow_newlines=is_nested)
        finally:
            self._nested = outer
        return _gbnf.SequenceNode(items), pos

    def _parse_token(self, pos: _gbnf.Position) -> tuple[_gbnf.ASTNode, _gbnf.Position]:
        """``<[id]>`` or ``<text>`` (what ``text`` tokenizes to, control tokens read, must be one
        token), either after ``!`` (any token but it), as llama.cpp's ``parse_token`` reads it."""
        negated = pos.current() == "!"
        if negated:
            pos = pos.advance()
        if pos.current() != "<":
            raise _gbnf.GbnfToLarkError(pos, "expected '<' (a token) after '!'")
        if pos.peek(2) == "<[":
            number, after = self._parse_int(pos.advance(2))
            if after.peek(2) != "]>":
                raise _gbnf.GbnfToLarkError(after, "expected ']>' to end the token id")
            if number > _MOST_TOKEN_ID:
                raise _gbnf.GbnfToLarkError(pos, f"the token id {number} is too big")
            return _Token(number, negated), after.advance(2)
        end = pos.text.find(">", pos.pos)
        if end < 0:
            raise _gbnf.GbnfToLarkError(pos, "expected '>' to end the token")
        written = pos.text[pos.pos : end + 1]
        if self._token_id is None:
            raise _gbnf.GbnfToLarkError(pos, f"no vocabulary to read the token {written!r} with")
        token = self._token_id(written)
        if token is None:
            raise _gbnf.GbnfToLarkError(pos, f"{written!r} is not one token of the model's vocabulary")
        return _Token(token, negated), _gbnf.Position(pos.text, end + 1)

    def _parse_repetition(self, pos: _gbnf.Position, nodes: list[_gbnf.ASTNode]) -> _gbnf.Position:
        """Each quantifier in a row applies to all before it: ``"a"+*`` is ``("a"+)*``."""
        while True:
            after = super()._parse_repetition(pos, nodes)
            if after.pos == pos.pos:
                return pos
            repeat = nodes[-1]
            assert isinstance(repeat, _gbnf.RepetitionNode)
            if repeat.min_times > _MOST_REPEATS:
                raise _gbnf.GbnfToLarkError(pos, f"more than {_MOST_REPEATS} repetitions")
            if repeat.max_times is not None and repeat.max_times > _MOST_REPEATS:
                repeat.max_times = None
            if repeat.max_times is not None and repeat.max_times < repeat.min_times:
                raise _gbnf.GbnfToLarkError(pos, "a repetition's most is below its least")
            pos = self._skip_space(after, self._nested)

    def _read_char(self, pos: _gbnf.Position) -> tuple[str, str, _gbnf.Position]:
        """The character at ``pos`` (an escape read), as written, and the place after it."""
        c = pos.current()
        if c == "":
            raise _gbnf.GbnfToLarkError(pos, "Unexpected end of input")
        if c != "\\":
            return c, c, pos.advance()
        kind = pos.peek(2)[1:]
        if kind in _ESCAPES:
            return _ESCAPES[kind], pos.peek(2), pos.advance(2)
        digits = _HEX_DIGITS.get(kind)
        if digits is None:
            raise _gbnf.GbnfToLarkError(pos, f"Invalid escape sequence \\{kind}")
        written = pos.peek(2 + digits)
        if len(written) != 2 + digits or not all(d in "0123456789abcdefABCDEF" for d in written[2:]):
            raise _gbnf.GbnfToLarkError(pos, f"Invalid \\{kind} escape sequence: {written}")
        code = int(written[2:], 16)
        if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
            raise _gbnf.GbnfToLarkError(pos, f"{written} is not a Unicode character")
        return chr(code), written, pos.advance(2 + digits)

    def _parse_literal(self, pos: _gbnf.Position) -> tuple[_gbnf.ASTNode, _gbnf.Position]:
        pos = pos.advance()  # the opening quote
        out: list[str] = []
        while pos.current() != '"':
            char, _, pos = self._read_char(pos)
            if char in _IN_LITERAL:
                out.append(_IN_LITERAL[char])
            elif char < " " or char == "\x7f":
                out.append(f"\\u{ord(char):04x}")
            else:
                out.append(char)
        return _gbnf.LiteralNode("".join(out)), pos.advance()

    def _parse_char_class(self, pos: _gbnf.Position) -> tuple[_gbnf.ASTNode, _gbnf.Position]:
        """As llama.cpp reads one: ``-`` between two characters (not before ``]``) is a range."""
        pos = pos.advance()  # [
        negated = pos.current() == "^"
        if negated:
            pos = pos.advance()
        items: list[str] = []
        empty = 0  # ranges that hold no character
        while pos.current() != "]":
            low, low_written, pos = self._read_char(pos)
            if pos.current() == "-" and pos.peek(2)[1:] not in ("]", ""):
                high, high_written, pos = self._read_char(pos.advance())
                if high < low:
                    empty += 1
                else:
                    items.append(f"{_in_class(low, low_written, True)}-{_in_class(high, high_written, True)}")
            else:
                items.append(_in_class(low, low_written, bool(items) or empty > 0))
        pos = pos.advance()
        if not items:
            if not empty:
                return _gbnf.LiteralNode(""), pos  # llama.cpp's [] is no element at all
            return _gbnf.RegexNode("(?s:.)" if negated else "[^\\s\\S]"), pos
        return _gbnf.RegexNode("[" + "^" * negated + "".join(items) + "]"), pos


def _in_class(char: str, written: str, escape_dash: bool) -> str:
    """``char`` inside a Lark regex class: as written where that reads the same there."""
    if len(written) > 1 and written[1] not in '"-':  # \x.., \u...., \n, \[, \]: the regex reads these
        return written
    if char in _CLASS_SYNTAX or (char == "-" and escape_dash):
        return "\\" + char
    if char < " " or char == "\x7f":
        return f"\\x{ord(char):02x}"
    return char


class _Token(_gbnf.ASTNode):
    """One token of the vocabulary by id, or (``negated``) any token but it."""

    def __init__(self, token: int, negated: bool) -> None:
        self.token = token
        self.negated = negated

    def __str__(self) -> str:
        return f"<[{'^' * self.negated}{self.token}]>"

    def is_terminal(self) -> bool:
        return False


class _Group(_gbnf.ASTNode):
    """A group llguidance's ``simplify`` would drop: written in parentheses under a quantifier."""

    def __init__(self, node: _gbnf.ASTNode) -> None:
        self.node = node

    def __str__(self) -> str:
        return str(self.node)

    def is_atomic(self) -> bool:
        return False

    def children(self) -> list[_gbnf.ASTNode]:
        return [self.node]


def _mend(node: _gbnf.ASTNode) -> _gbnf.ASTNode:
    """``node`` as Lark must have it, llama.cpp's meaning kept (see the module's notes)."""
    if isinstance(node, _gbnf.RepetitionNode):
        if node.max_times == 0:
            return _gbnf.LiteralNode("")
        if isinstance(node.node, _gbnf.RepetitionNode):
            node.node = _Group(node.node)
    elif isinstance(node, _gbnf.RegexNode) and node.rx == ".":
        return _gbnf.RegexNode("(?s:.)")
    return node


def _mend_children(node: _gbnf.ASTNode) -> None:
    if isinstance(node, _gbnf.SequenceNode):
        node.nodes = [_mend(child) for child in node.nodes]
    elif isinstance(node, _gbnf.AlternativeNode):
        node.alternatives = [_mend(child) for child in node.alternatives]
    elif isinstance(node, (_gbnf.RepetitionNode, _Group)):
        node.node = _mend(node.node)


def _link(rules: dict[str, _gbnf.RuleNode]) -> tuple[dict[str, set[str]], set[str]]:
    """Simplify each rule and mend it for Lark, point each reference at its rule; each rule's
    references, by name, and the names of the rules that hold a token."""
    refers: dict[str, set[str]] = {}
    holding: set[str] = set()
    for order, rule in enumerate(rules.values()):
        rule.order = order
        rule.alternatives = _mend(rule.alternatives.simplify())
        names: set[str] = set()
        pending: list[_gbnf.ASTNode] = [rule.alternatives]
        while pending:
            node = pending.pop()
            _mend_children(node)
            if isinstance(node, _Token):
                holding.add(rule.name)
            elif isinstance(node, _gbnf.RuleRefNode):
                target = rules.get(node.name)
                if target is None:
                    raise GbnfError(f"the GBNF grammar refers to a rule '{node.name}' it does not define")
                node.target = target
                names.add(node.name)
            pending.extend(node.children())
        refers[rule.name] = names
    return refers, holding


def _mark_terminals(rules: dict[str, _gbnf.RuleNode], refers: dict[str, set[str]], holding: set[str]) -> None:
    """Mark the rules that refer only to terminals (root never is one, nor one that holds a
    token): a rule becomes one when the last rule it waits for does."""
    # A rule that holds a token waits for one more, which never comes.
    waiting = {name: len(names) + (name in holding) for name, names in refers.items()}
    users: dict[str, list[str]] = {name: [] for name in rules}
    for name, names in refers.items():
        for target in names:
            users[target].append(name)
    ready = [name for name, count in waiting.items() if count == 0 and name != "root"]
    while ready:
        name = ready.pop()
        rules[name].rule_is_terminal = True
        for user in users[name]:
            waiting[user] -= 1
            if waiting[user] == 0 and user != "root":
                ready.append(user)


def _rename(rules: dict[str, _gbnf.RuleNode]) -> None:
    """Lark's names: root is start, terminals in capitals, other rules in snake case; a name
    that is none in Lark gets a prefix, and one already taken a number."""
    taken = {"start"}
    for rule in rules.values():
        if rule.name == "root":
            rule.name = "start"
            continue
        name = _CAMEL.sub(r"\1_\2", rule.name.replace("-", "_"))
        if not _LARK_NAME.fullmatch(name):
            name = "r_" + name
        name = name.upper() if rule.rule_is_terminal else name.lower()
        given, number = name, 1
        while name in taken:
            number += 1
            name = f"{given}_{number}"
        taken.add(name)
        rule.name = name
