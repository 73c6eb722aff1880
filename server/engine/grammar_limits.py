"""What a grammar may be before llguidance compiles it, measured by a cheap walk of our own, and
the resources a compile gets. Every bound is here, with the measurement behind it.

llguidance's compiler recurses along chains of rules and of nested or referenced schemas; past
a few thousand links it overflows its thread's stack and takes the process down (a segfault,
not an exception). Its time grows with a schema's properties (quadratically with the optional
properties of one object) and with a grammar's rules, and its own ``max_grammar_size`` is checked
only after most of that work. So a grammar is walked first (``check_schema_text``,
``check_gbnf``, ``check_lark``: linear, no recursion past the bounds), refused with
``TooComplex`` (a 400 naming the field) when it is past a bound, and only then compiled, in a
thread whose stack the bounds make ample.

Measured here (SmolLM2's tokenizer, llguidance 1.9.1, a 2-core VM), the compile's stack
overflows at 8 MiB (a thread's default) after about 1,700 nested schemas counted as below
(900 objects each holding the next through a property and a ``$ref``, 2,450 plain ``$ref``
hops, 1,030 ``anyOf`` links, 870 ``prefixItems``: about 5 KiB a schema) and 3,480 chained GBNF
rules (2.4 KiB a rule); the depth grows with the stack (4x the stack, 4x the depth). CPU time
within the bounds, on an idle core: at most about 0.4 s (10,000 subschemas in various shapes:
0.25-0.35 s; 10,000 grammar symbols: ~0.4 s), against 15 s for the issue's 8,000 optional
properties.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urldefrag, urljoin, urlsplit

if TYPE_CHECKING:
    import llguidance

# -- the compile's resources --------------------------------------------------------------------

# The stack of a compile thread. Within the bounds below the deepest compile needs about
# 0.7 MiB (128 nested schemas x ~5 KiB) or 2.4 MiB (1,000 chained rules x 2.4 KiB); should a
# $ref escape our walk, every subschema allowed on one path (10,000) is ~50 MiB. 256 MiB
# overflows past ~50,000 (measured: 5,000 objects each holding the next, 10,000 subschemas,
# compile on it and on 64 MiB). Only the pages a compile touches are memory; the rest is
# address space, and there are COMPILE_THREADS such stacks at most.
COMPILE_STACK_BYTES = 256 * 1024 * 1024
# Compiles run one at a time: each takes a core (the decode thread needs the other on 2 cores),
# and, within the bounds, one takes well under a second, so a queue of them moves.
COMPILE_THREADS = 1
# At shutdown, how long the engine waits for a compile still running (abandoned by its client:
# it reads the vocabulary, so the model is freed only once it is done). Bounds keep compiles far
# shorter; this only bounds the wait.
COMPILE_EXIT_WAIT = 10.0


# llguidance's own resource bounds for one grammar (its units; its defaults are 2,000 /
# 1,000,000 / 200,000 / 50,000 / 250,000 / 500,000). Past them a compile is a 400 and a decode
# step an error. ``max_items_in_row`` stays at its default: it is what fails an object of
# hundreds of optional properties at the step that chooses one (see MAX_OPTIONAL_PROPERTIES).
@cache
def parser_limits() -> llguidance.LLParserLimits:
    import llguidance  # at the first compile, not at the start (see ``grammar``)

    return llguidance.LLParserLimits(
        initial_lexer_fuel=1_000_000,
        step_lexer_fuel=200_000,
        step_max_items=50_000,
        max_lexer_states=100_000,
        max_grammar_size=200_000,
        verbose_errors=False,  # messages go back to clients: no grammar dumps
    )


# -- JSON Schema --------------------------------------------------------------------------------

# Schemas nested in one another along one path, each ``$ref`` followed counting one (a property
# holding an object is two: the property's schema and the object). OpenAI allows 10 levels of
# objects; this is 13x below the 8 MiB overflow and 100x below COMPILE_STACK_BYTES'.
MAX_SCHEMA_DEPTH = 128
# Schemas in all (every object, property, item, branch, definition; a boolean schema too). Time
# grows with them: 10,000 in any shape measured here compiled in at most ~0.35 s.
MAX_SCHEMA_NODES = 10_000
# Properties of one object. Time grows faster than linearly within one object (10,000 in one:
# 1.1 s; 2,000: ~0.1 s). OpenAI allows 5,000 in a whole schema.
MAX_OBJECT_PROPERTIES = 2_000
# Optional properties (not ``required``) of one object: compile time is quadratic in them (8,000
# took 15 s), and choosing the next of n takes a row of about 4n items, which past
# ``max_items_in_row`` (2,000) fails in the middle of an answer: 256 keeps that row near 1,000.
MAX_OPTIONAL_PROPERTIES = 256
# Optional properties in all: each object of 256 costs ~17 ms, so this keeps their sum ~0.15 s.
MAX_OPTIONAL_TOTAL = 2_000

# -- GBNF and Lark ------------------------------------------------------------------------------

# Rules (and Lark terminals): chained rules are compiled by recursion (3,480 overflow 8 MiB), and
# llguidance's GBNF reader takes time quadratic in them (see ``gbnf.py``). Grammars written by
# hand have tens; llama.cpp's JSON-schema converter makes hundreds for large schemas.
MAX_GRAMMAR_RULES = 1_000
# Literals, character classes, regular expressions and rule references: time grows with them
# (20,000 optional literals in a row: 1.0 s; 10,000: ~0.4 s).
MAX_GRAMMAR_SYMBOLS = 10_000
# Groups nested in groups: the GBNF reader recurses on them (three Python frames a level).
MAX_GRAMMAR_NESTING = 64

# Keywords whose value is a schema (or, for "items", an array of schemas), an object of schemas,
# or an array of schemas.
_ONE, _MANY, _LIST = 1, 2, 3
_KEYWORDS = {
    **dict.fromkeys(("additionalProperties", "additionalItems", "contains", "not", "if", "then", "else"), _ONE),
    **dict.fromkeys(("propertyNames", "unevaluatedItems", "unevaluatedProperties", "contentSchema", "items"), _ONE),
    **dict.fromkeys(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"), _MANY),
    **dict.fromkeys(("anyOf", "oneOf", "allOf", "prefixItems"), _LIST),
}


class TooComplex(ValueError):
    """The grammar is past one of the bounds; the message says which, and where."""


def check_schema_text(source: str) -> None:
    """Raise ``TooComplex`` when the JSON Schema in ``source`` (JSON text) is past a bound. Text
    that is not JSON is left for llguidance to refuse."""
    try:
        schema = json.loads(source)
    except (ValueError, RecursionError):
        return
    check_schema(schema, _Budget())


@dataclass
class _Budget:
    """What the schemas of one grammar have used so far (a Lark grammar may hold several)."""

    nodes: int = 0
    optional: int = 0


def check_schema(schema: Any, budget: _Budget | None = None) -> None:
    """Walk ``schema`` once (each ``$ref`` target once, however often it is referred to) and
    raise ``TooComplex`` at the first bound it passes."""
    _Walk(schema, budget or _Budget()).height(schema, "#", 1)


# Where a schema sits, as a JSON pointer made only when an error names it: (parent, step) pairs.
_Where = tuple[Any, str] | str


def _pointer(where: _Where) -> str:
    steps: list[str] = []
    while isinstance(where, tuple):
        where, step = where
        steps.append(step.replace("~", "~0").replace("/", "~1"))
    return "/".join([where, *reversed(steps)])


class _Walk:
    def __init__(self, root: Any, budget: _Budget) -> None:
        self.refs = _References(root)
        self.budget = budget
        self.heights: dict[int, int] = {}  # id(schema) -> schemas on its longest path down
        self.open: set[int] = set()  # schemas on the current path: a $ref to one is a cycle

    def height(self, node: Any, where: _Where, depth: int) -> int:
        """The schemas on the longest path down from ``node`` (itself included), which sits
        ``depth`` schemas below the root (it is the root at 1)."""
        key = id(node)
        if key in self.open:
            return 0  # a recursive schema: compiled as a rule that refers to itself
        known = self.heights.get(key)
        if known is None:
            if depth > MAX_SCHEMA_DEPTH:
                raise _too_deep(where)
            self.budget.nodes += 1
            if self.budget.nodes > MAX_SCHEMA_NODES:
                raise TooComplex(f"the schema has more than {MAX_SCHEMA_NODES} subschemas (at {_pointer(where)})")
            self.open.add(key)
            known = 1
            for child, at in self._below(node, where):
                known = max(known, 1 + self.height(child, at, depth + 1))
            self.open.discard(key)
            self.heights[key] = known
        if depth - 1 + known > MAX_SCHEMA_DEPTH:
            raise _too_deep(where)
        return known

    def _below(self, node: Any, where: _Where) -> list[tuple[Any, _Where]]:
        """The schemas directly under ``node``: its subschemas, and the target of its $ref."""
        if not isinstance(node, dict):
            return []
        below: list[tuple[Any, _Where]] = []
        for word, value in node.items():
            kind = _KEYWORDS.get(word)
            if kind is None:
                if word == "$ref" and isinstance(value, str) and (target := self.refs.target(node, value)) is not None:
                    below.append((target, value))
            elif (isinstance(value, dict) and kind != _MANY) or isinstance(value, bool):
                below.append((value, (where, word)))
            elif isinstance(value, dict):
                if word == "properties":
                    self._count_properties(node, value, where)
                below.extend((child, ((where, word), str(name))) for name, child in value.items())
            elif isinstance(value, list) and (kind == _LIST or word == "items"):
                below.extend((child, ((where, word), str(i))) for i, child in enumerate(value))
        return below

    def _count_properties(self, node: dict[str, Any], properties: dict[str, Any], where: _Where) -> None:
        if len(properties) > MAX_OBJECT_PROPERTIES:
            raise TooComplex(f"an object has more than {MAX_OBJECT_PROPERTIES} properties, at {_pointer(where)}")
        required = node.get("required")
        names = {name for name in required if isinstance(name, str)} if isinstance(required, list) else set()
        optional = sum(1 for name in properties if name not in names)
        if optional > MAX_OPTIONAL_PROPERTIES:
            what = f"more than {MAX_OPTIONAL_PROPERTIES} optional properties (not required)"
            raise TooComplex(f"an object has {what}, at {_pointer(where)}")
        self.budget.optional += optional
        if self.budget.optional > MAX_OPTIONAL_TOTAL:
            raise TooComplex(
                f"the schema has more than {MAX_OPTIONAL_TOTAL} optional properties in all (at {_pointer(where)})"
            )


def _too_deep(where: _Where) -> TooComplex:
    what = f"more than {MAX_SCHEMA_DEPTH} levels deep (each $ref counts)"
    return TooComplex(f"the schema nests {what}, at {_pointer(where)}")


class _References:
    """Where the ``$ref`` of a document point: its resources (a schema with an ``$id`` is the
    base of the references written inside it), their anchors, and JSON pointers in them. What
    does not resolve here is left for llguidance to refuse (or to resolve: a schema's subschemas
    are bounded in number anyway, and COMPILE_STACK_BYTES holds them all on one path)."""

    def __init__(self, root: Any) -> None:
        self.base: dict[int, str] = {}  # id(schema) -> the base URI of references in it
        self.resources: dict[str, Any] = {"": root}
        self.anchors: dict[str, Any] = {}
        pending: list[tuple[Any, str]] = [(root, "")]
        while pending:
            node, base = pending.pop()
            if isinstance(node, list):
                pending.extend((item, base) for item in node)
                continue
            if not isinstance(node, dict):
                continue
            own, anchor = node.get("$id"), node.get("$anchor")
            if isinstance(own, str) and own.startswith("#"):
                anchor = own[1:]  # drafts 6 and 7 named anchors with $id
            elif isinstance(own, str):
                base = urldefrag(_join(base, own)).url
                self.resources.setdefault(base, node)
            if isinstance(anchor, str):
                self.anchors.setdefault(f"{base}#{anchor}", node)
            self.base[id(node)] = base
            pending.extend((value, base) for value in node.values())

    def target(self, node: dict[str, Any], ref: str) -> Any:
        """The schema that ``ref``, written in ``node``, points at; None when it is not here."""
        base = self.base.get(id(node), "")
        uri, fragment = (base, ref[1:]) if ref.startswith("#") else urldefrag(_join(base, ref))
        fragment = unquote(fragment)
        resource = self.resources.get(uri)
        if resource is None:
            return None
        if not fragment.startswith("/"):
            target = self.anchors.get(f"{uri}#{fragment}") if fragment else resource
        else:
            target = resource
            for part in fragment[1:].split("/"):
                part = part.replace("~1", "/").replace("~0", "~")
                if isinstance(target, dict) and part in target:
                    target = target[part]
                elif (
                    isinstance(target, list)
                    and part.isascii()
                    and part.isdigit()
                    and len(part) < 10
                    and int(part) < len(target)
                ):
                    target = target[int(part)]
                else:
                    return None
        return target if isinstance(target, (dict, bool)) else None


def _join(base: str, ref: str) -> str:
    return ref if urlsplit(ref).scheme else urljoin(base, ref)


# -- GBNF and Lark ------------------------------------------------------------------------------

# One token of a grammar's text at a time (quoted text, classes, regular expressions and comments
# whole), so that what they hold is never taken for rules or groups.
_GBNF_TOKENS = re.compile(
    r"""(?P<symbol>"(?:\\.|[^"\\])*"?|\[(?:\\.|[^\]\\])*\]?|[A-Za-z0-9_-]+|\.)
    |(?P<rule>::=)|(?P<open>\()|(?P<close>\))|(?P<skip>\#[^\n]*|[^"\[A-Za-z0-9_.:()\#-]+|.)""",
    re.X | re.S,
)
_LARK_TOKENS = re.compile(
    r"""(?P<rule>^[ \t]*[?!]?[A-Za-z_]\w*(?:\.-?\d+)?[ \t]*:(?!:))
    |(?P<json>%json\b)|(?P<skip>//[^\n]*|[ \t\r]+|\n)
    |(?P<symbol>"(?:\\.|[^"\\])*"?|/(?:\\.|[^/\\\n])*/?|%?[A-Za-z_]\w*)
    |(?P<open>[(\[{])|(?P<close>[)\]}])|(?P<other>.)""",
    re.X | re.S | re.M,
)


def check_gbnf(text: str) -> None:
    """Raise ``TooComplex`` when a GBNF grammar has too many rules or nests too deep: checked
    before it is read (reading takes time with the first and recursion with the second)."""
    _scan(text, _GBNF_TOKENS)


def check_lark(text: str) -> None:
    """Raise ``TooComplex`` when a Lark grammar (llguidance's dialect, or GBNF turned into it)
    is past a bound; the JSON schemas it holds (``%json {...}``) are checked as schemas."""
    _scan(text, _LARK_TOKENS)


def _scan(text: str, tokens: re.Pattern[str]) -> None:
    """Count a grammar's rules, symbols and nesting in one pass over its tokens; schemas after
    ``%json`` are checked on the way, sharing one budget."""
    rules = symbols = depth = 0
    budget = _Budget()
    i = 0
    while i < len(text):
        token = tokens.match(text, i)
        assert token is not None  # every pattern ends with "any one character"
        kind, i = token.lastgroup, token.end()
        if kind == "rule":
            rules += 1
            if rules > MAX_GRAMMAR_RULES:
                raise TooComplex(f"the grammar has more than {MAX_GRAMMAR_RULES} rules")
        elif kind == "symbol" or kind == "json":
            symbols += 1
            if symbols > MAX_GRAMMAR_SYMBOLS:
                raise TooComplex(f"the grammar has more than {MAX_GRAMMAR_SYMBOLS} symbols (literals, classes, names)")
            if kind == "json":
                i = _check_embedded(text, i, budget)
        elif kind == "open":
            depth += 1
            if depth > MAX_GRAMMAR_NESTING:
                raise TooComplex(f"the grammar nests groups more than {MAX_GRAMMAR_NESTING} deep")
        elif kind == "close":
            depth = max(depth - 1, 0)


_SPACE = re.compile(r"\s*")


def _check_embedded(text: str, i: int, budget: _Budget) -> int:
    """Check the JSON schema that follows ``%json`` at ``i``; where the scan goes on."""
    start = _SPACE.match(text, i).end()  # type: ignore[union-attr]
    try:
        schema, end = json.JSONDecoder().raw_decode(text, start)
    except (ValueError, RecursionError):
        return start  # not JSON: llguidance says what is wrong
    check_schema(schema, budget)
    return int(end)
