"""The bounds on what reaches llguidance's compiler (``grammar_limits``), our linear GBNF reader
(``gbnf``), and compile admission (``compiler.GrammarCompiler``): pure checks without a model,
then compiles with the real tokenizer, and the stack measurement the bounds rest on."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import trio
import trio.testing
from llguidance.gbnf_to_lark import any_to_lark

import ffi
from server.engine import Overloaded, ShuttingDown
from server.engine import grammar_limits as limits
from server.engine.compiler import GrammarCompiler
from server.engine.gbnf import GbnfError, to_lark
from server.engine.grammar import GrammarCache, GrammarError, build_tokenizer
from tests.support.grammars import (
    any_of_chain,
    chain,
    gbnf_chain,
    lark_chain,
    optional_properties,
    properties_chain,
    ref,
    ref_chain,
)
from tests.support.process import ROOT


# The deepest nesting each chain reaches, in schemas as the walk counts them: root, the chain's
# links (1, 2 or 2 each) and the last.
def _depth_of(kind: str, n: int) -> int:
    return {"ref": n + 2, "properties": 2 * n + 2, "anyOf": 2 * n + 2}[kind]


def test_depth_is_counted_through_refs_and_refused_just_past_the_bound() -> None:
    bound = limits.MAX_SCHEMA_DEPTH
    for kind, make, links in (
        ("ref", ref_chain, bound - 2),
        ("properties", properties_chain, bound // 2 - 1),
        ("anyOf", any_of_chain, bound // 2 - 1),
    ):
        assert _depth_of(kind, links) == bound
        limits.check_schema_text(json.dumps(make(links)))
        with pytest.raises(limits.TooComplex, match=f"more than {bound} levels deep"):
            limits.check_schema_text(json.dumps(make(links + 1)))


def test_the_issues_crashing_schemas_are_refused_with_their_place() -> None:
    for schema, where in (
        (ref_chain(3000), "#/$defs/d127"),
        (properties_chain(1000), "#/$defs/d63/properties/a"),
        (any_of_chain(2000), "#/$defs/d63/anyOf/0"),
    ):
        with pytest.raises(limits.TooComplex) as refused:
            limits.check_schema_text(json.dumps(schema))
        assert str(refused.value).endswith(f"at {where}")


def test_references_resolve_through_ids_anchors_and_escapes() -> None:
    too_deep = limits.MAX_SCHEMA_DEPTH
    # A tool's parameters inside the answer's schema: with an $id, "#/..." is the tool's own.
    for own in ("urn:tool", "http://example.com/tool.json"):
        wrapped = {"anyOf": [{"type": "null"}, {"properties": {"arguments": {"$id": own, **ref_chain(too_deep)}}}]}
        with pytest.raises(limits.TooComplex, match="levels deep"):
            limits.check_schema_text(json.dumps(wrapped))
    by_uri = {"$defs": {"a": {"$id": "http://example.com/a.json", **ref_chain(too_deep)}}, "$ref": "a.json"}
    by_uri["$id"] = "http://example.com/root.json"
    anchors = {f"d{i}": {"$anchor": f"a{i}", "$ref": f"#a{i + 1}"} for i in range(too_deep)}
    old_anchors = {f"d{i}": {"$id": f"#a{i}", "$ref": f"#a{i + 1}"} for i in range(too_deep)}
    escaped = {f"d /{i}": {"$ref": f"#/$defs/d%20~1{i + 1}"} for i in range(too_deep)}
    for defs, last in ((anchors, {"$anchor": f"a{too_deep}"}), (old_anchors, {"$id": f"#a{too_deep}"})):
        defs[f"d{too_deep}"] = last
    for schema in (by_uri, {"$defs": anchors, "$ref": "#a0"}, {"$defs": old_anchors, "$ref": "#a0"}):
        with pytest.raises(limits.TooComplex, match="levels deep"):
            limits.check_schema_text(json.dumps(schema))
    with pytest.raises(limits.TooComplex, match="levels deep"):
        limits.check_schema_text(json.dumps({"$defs": escaped, "$ref": "#/$defs/d%20~10"}))


def test_recursive_and_shared_schemas_are_walked_once() -> None:
    tree = {
        "$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": ref(0)}}}},
        "$ref": "#/$defs/node",
    }
    tree["$defs"]["node"]["properties"]["kids"]["items"] = {"$ref": "#/$defs/node"}
    limits.check_schema_text(json.dumps(tree))
    # Each level refers twice to the next: 2**60 paths, one walk of 61 schemas.
    doubling = chain(lambda i: {"allOf": [ref(i + 1), ref(i + 1)]}, 60)
    limits.check_schema_text(json.dumps(doubling))


def test_properties_bounds() -> None:
    most = limits.MAX_OPTIONAL_PROPERTIES
    limits.check_schema_text(json.dumps(optional_properties(most)))
    with pytest.raises(limits.TooComplex, match=f"more than {most} optional properties"):
        limits.check_schema_text(json.dumps(optional_properties(most + 1)))
    limits.check_schema_text(json.dumps(optional_properties(most + 1, required=1)))
    # The issue's 8,000 optional properties (compiled for 15 s, then failed at the first step).
    with pytest.raises(limits.TooComplex, match="properties"):
        limits.check_schema_text(json.dumps(optional_properties(8000)))
    in_all = limits.MAX_OPTIONAL_TOTAL // most + 1
    many = {"type": "object", "properties": {f"o{j}": optional_properties(most) for j in range(in_all)}}
    with pytest.raises(limits.TooComplex, match=f"more than {limits.MAX_OPTIONAL_TOTAL} optional properties in all"):
        limits.check_schema_text(json.dumps(many))
    wide = limits.MAX_OBJECT_PROPERTIES
    limits.check_schema_text(json.dumps(optional_properties(wide, required=wide)))
    with pytest.raises(limits.TooComplex, match=f"more than {wide} properties"):
        limits.check_schema_text(json.dumps(optional_properties(wide + 1, required=wide + 1)))


def test_subschemas_in_all_are_bounded() -> None:
    most = limits.MAX_SCHEMA_NODES
    # root + one anyOf branch each + (one object + its properties) per branch
    branches = [optional_properties(99, required=99) for _ in range((most - 1) // 100)]
    assert 1 + 100 * len(branches) <= most
    limits.check_schema_text(json.dumps({"anyOf": branches}))
    with pytest.raises(limits.TooComplex, match=f"more than {most} subschemas"):
        limits.check_schema_text(json.dumps({"anyOf": [*branches, optional_properties(99, required=99)]}))


def test_text_that_is_not_json_is_left_to_llguidance() -> None:
    limits.check_schema_text("{not json")


def test_grammar_rules_symbols_and_nesting() -> None:
    most = limits.MAX_GRAMMAR_RULES
    limits.check_gbnf(gbnf_chain(most))
    limits.check_lark(lark_chain(most))
    for check, text in ((limits.check_gbnf, gbnf_chain(most + 1)), (limits.check_lark, lark_chain(most + 1))):
        with pytest.raises(limits.TooComplex, match=f"more than {most} rules"):
            check(text)
    # Indenting Lark rules does not hide them.
    with pytest.raises(limits.TooComplex, match="rules"):
        limits.check_lark(lark_chain(most + 1).replace("\nr", "\n   r"))
    # What quotes, classes and comments hold is not counted.
    limits.check_gbnf('root ::= "' + "::= (" * 5000 + '" [(((] # ((( ::=\n')
    deep = limits.MAX_GRAMMAR_NESTING
    limits.check_gbnf("root ::= " + "(" * deep + '"x"' + ")" * deep)
    with pytest.raises(limits.TooComplex, match=f"more than {deep} deep"):
        limits.check_gbnf("root ::= " + "(" * (deep + 1) + '"x"' + ")" * (deep + 1))
    symbols = limits.MAX_GRAMMAR_SYMBOLS
    limits.check_lark("start: " + " ".join(f'"w{i}"?' for i in range(symbols)))
    with pytest.raises(limits.TooComplex, match=f"more than {symbols} symbols"):
        limits.check_lark("start: " + " ".join(f'"w{i}"?' for i in range(symbols + 1)))


def test_schemas_inside_lark_are_walked() -> None:
    limits.check_lark("start: %json " + json.dumps(ref_chain(10)))
    with pytest.raises(limits.TooComplex, match="levels deep"):
        limits.check_lark("start: %json " + json.dumps(ref_chain(3000)))


# -- GBNF to Lark -------------------------------------------------------------------------------

GRAMMARS = [
    'root ::= " yes" | " no"',
    'root ::= myRule my-other\nmyRule ::= [a-z]+ # a comment\nmy-other ::= "x" myRule | "y"\n',
    'root ::= a b\na ::= b "c"\nb ::= "d"{2,5} a?\n',  # a cycle: neither is a terminal
    'root ::= item ("," item)*\nitem ::= [0-9]+ | "(" root ")"\n',
    gbnf_chain(30),
    'start: "already lark"\n',
    # JSON, more or less, with whitespace rules and escapes
    r"""root   ::= value
value  ::= obj | arr | str | num | ("true" | "false" | "null")
obj    ::= "{" ws (member ("," ws member)*)? "}"
member ::= str ws ":" ws value ws
arr    ::= "[" ws (value ws ("," ws value ws)*)? "]"
str    ::= "\"" ([^"\\\x00-\x1F] | "\\" ["\\/bfnrt])* "\""
num    ::= "-"? [0-9]+ ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
ws     ::= [ \t\n]{0,20}
""",
    # arithmetic, with a rule used before it is defined and one spread over lines
    """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (
    ("*" | "/") factor
  )*
factor ::= number | "(" expr ")"
number ::= digit+ ("." digit+)?
digit ::= [0-9]
""",
    'root ::= "é" [a-z\\x41-\\x5A]{1,3} [^\\n]{2}\n',
]
# (Where llguidance's conversion writes Lark that is refused or means otherwise, ``test_gbnf``
# has the forms and what they match.)


def test_gbnf_reads_as_llguidance_reads_it() -> None:
    for grammar in GRAMMARS:
        assert to_lark(grammar) == any_to_lark(grammar)


def test_gbnf_errors() -> None:
    for text, needle in (
        ('item ::= "x"', "no 'root' rule"),
        ("root ::= missing", "'missing'"),
        ("root ::= ((", "cannot read"),
    ):
        with pytest.raises(GbnfError, match=needle):
            to_lark(text)


# -- compiles with the real tokenizer -----------------------------------------------------------


@pytest.fixture(scope="module")
def cache(model: ffi.Model) -> GrammarCache:
    return GrammarCache(build_tokenizer(model.vocab, model.vocab.eog_tokens))


def build_on_compile_stack(cache: GrammarCache, kind: Any, source: str) -> str:
    """``cache.build`` in a thread with the compile threads' stack: "ok" or the error."""
    result: list[str] = []

    def run() -> None:
        try:
            cache.build(kind, source)
            result.append("ok")
        except GrammarError as exc:
            result.append(str(exc))

    previous = threading.stack_size(limits.COMPILE_STACK_BYTES)
    try:
        thread = threading.Thread(target=run)
        thread.start()
    finally:
        threading.stack_size(previous)
    thread.join()
    return result[0]


def test_sizes_at_the_bounds_compile_and_past_them_are_refused(cache: GrammarCache) -> None:
    depth = limits.MAX_SCHEMA_DEPTH
    for schema in (ref_chain(depth - 2), properties_chain(depth // 2 - 1), any_of_chain(depth // 2 - 1)):
        assert build_on_compile_stack(cache, "json_schema", json.dumps(schema)) == "ok"
    assert build_on_compile_stack(cache, "gbnf", gbnf_chain(limits.MAX_GRAMMAR_RULES)) == "ok"
    for kind, source in (
        ("json_schema", json.dumps(ref_chain(3000))),
        ("json_schema", json.dumps(properties_chain(1000))),
        ("json_schema", json.dumps(any_of_chain(2000))),
        ("gbnf", gbnf_chain(4000)),
        ("lark", lark_chain(limits.MAX_GRAMMAR_RULES + 1)),
    ):
        assert "more than" in build_on_compile_stack(cache, kind, source)  # type: ignore[arg-type]


def test_a_grammar_that_fails_its_first_steps_fails_to_compile(cache: GrammarCache) -> None:
    # 3,000 branches: the first step's row has 3,000 items, past llguidance's 2,000.
    branches = [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]} for i in range(3000)
    ]
    assert "max is 2000" in build_on_compile_stack(cache, "json_schema", json.dumps({"anyOf": branches}))
    # The same after the forced text: the choice of a property comes after '{"a": {'.
    forced = {"type": "object", "properties": {"a": {"anyOf": branches}}, "required": ["a"]}
    assert "max is 2000" in build_on_compile_stack(cache, "json_schema", json.dumps(forced))


_OVERFLOW = """
import json, sys, threading
sys.path.insert(0, ".")
import ffi, llguidance
from server.engine.grammar import JSON_OPTIONS, build_tokenizer
from server.engine.grammar_limits import parser_limits
from server.model_files import default_model_path
model = ffi.Model(str(default_model_path()))
tokenizer = build_tokenizer(model.vocab, model.vocab.eog_tokens)
schema = json.loads(sys.stdin.read())
def run():
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    assert not llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits()).is_error()
threading.stack_size(int(sys.argv[1]))
thread = threading.Thread(target=run)
thread.start()
thread.join()
print("compiled")
"""


@pytest.mark.model  # the subprocess loads the default model's vocabulary
@pytest.mark.parametrize(
    ("stack", "links"), [(8 * 1024 * 1024, 1000), (limits.COMPILE_STACK_BYTES, 5000)], ids=["8MiB", "compile-stack"]
)
def test_the_stack_measurement_behind_the_bounds(stack: int, links: int) -> None:
    # 1,000 objects each holding the next (2,002 schemas deep, 16x the bound) overflow a thread's
    # default 8 MiB in llguidance's compiler (the process dies). A compile thread's stack holds
    # 5,000 (10,002 deep: every subschema MAX_SCHEMA_NODES allows, on one path).
    done = subprocess.run(
        [sys.executable, "-c", _OVERFLOW, str(stack)],
        input=json.dumps(properties_chain(links)),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    if stack == limits.COMPILE_STACK_BYTES:
        assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-2000:]
    else:
        assert done.returncode == -11, (done.returncode, done.stdout[-500:])


# -- admission ----------------------------------------------------------------------------------


class _SlowCache:
    """A stand-in for ``GrammarCache`` whose builds wait until released, counting them."""

    def __init__(self) -> None:
        self.built: list[str] = []
        self.release = threading.Event()
        self._grammars: dict[Any, Any] = {}

    def get(self, key: Any) -> Any:
        return self._grammars.get(key)

    def put(self, key: Any, grammar: Any) -> None:
        self._grammars[key] = grammar

    def build(self, kind: str, source: str) -> Any:
        self.built.append(source)
        assert self.release.wait(30)
        if source == "bad":
            raise GrammarError("bad grammar")
        return ("grammar", source)


@pytest.fixture
def slow() -> Iterator[_SlowCache]:
    cache = _SlowCache()
    yield cache
    cache.release.set()


async def _until(condition: Callable[[], bool]) -> None:
    with trio.fail_after(10):
        while not condition():
            await trio.sleep(0.005)


async def test_compiles_queue_for_one_thread_and_count_with_the_engine_queue(slow: _SlowCache) -> None:
    queued = 1  # jobs in the engine's queue
    compiler = GrammarCompiler(slow, queued=lambda: queued, max_queue=4)  # type: ignore[arg-type]
    results: dict[str, Any] = {}

    async def ask(source: str, scope: str = "a") -> None:
        try:
            results[source] = await compiler.compile("lark", source, scope)
        except Exception as exc:
            results[source] = exc

    async with trio.open_nursery() as nursery:
        for source in ("s0", "s1", "s2", "s3"):  # in this order
            nursery.start_soon(ask, source)
            await trio.testing.wait_all_tasks_blocked()
        await _until(lambda: compiler.stats.running == 1 and compiler.stats.waiting == 3)
        # 3 waiting + 1 job queued: the next is refused, but a cached one would not be.
        nursery.start_soon(ask, "s4")
        await _until(lambda: "s4" in results)
        assert isinstance(results["s4"], Overloaded) and compiler.stats.overloaded == 1
        assert slow.built == ["s0"]
        slow.release.set()
    assert results == {**{f"s{i}": ("grammar", f"s{i}") for i in range(4)}, "s4": results["s4"]}
    assert slow.built == ["s0", "s1", "s2", "s3"] and compiler.stats.compiles == 4
    assert await compiler.compile("lark", "s2", "a") == ("grammar", "s2")
    assert compiler.stats.cache_hits == 1
    # Another scope compiles its own.
    with trio.fail_after(10):
        assert await compiler.compile("lark", "s2", "b") == ("grammar", "s2")
    assert slow.built[-1] == "s2" and compiler.stats.compiles == 5


async def test_a_caller_that_leaves_leaves_the_queue_and_the_running_compile_finishes(slow: _SlowCache) -> None:
    compiler = GrammarCompiler(slow, queued=lambda: 0, max_queue=8)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        scopes = [trio.CancelScope() for _ in range(3)]

        async def ask(i: int) -> None:
            with scopes[i]:
                await compiler.compile("lark", f"s{i}", "a")

        for i in range(3):
            nursery.start_soon(ask, i)
            await trio.testing.wait_all_tasks_blocked()
        await _until(lambda: compiler.stats.running == 1 and compiler.stats.waiting == 2)
        for scope in scopes:
            scope.cancel()
        await _until(lambda: compiler.stats.waiting == 0)
        assert compiler.stats.abandoned == 3 and compiler.stats.running == 1  # s0 runs on, bounded
        slow.release.set()
        await _until(lambda: compiler.stats.running == 0)
    assert slow.built == ["s0"]  # s1 and s2 never compiled
    assert await compiler.compile("lark", "s0", "a") == ("grammar", "s0")  # s0's result was kept
    assert compiler.stats.cache_hits == 1


async def test_one_compile_for_callers_of_the_same_grammar_and_errors_reach_all(slow: _SlowCache) -> None:
    compiler = GrammarCompiler(slow, queued=lambda: 0, max_queue=8)  # type: ignore[arg-type]
    errors: list[BaseException] = []

    async def ask() -> None:
        try:
            await compiler.compile("lark", "bad", "a")
        except GrammarError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(ask)
        await _until(lambda: compiler.stats.running == 1)
        await trio.testing.wait_all_tasks_blocked()
        slow.release.set()
    assert len(errors) == 3 and slow.built == ["bad"] and compiler.stats.failures == 1


async def test_stop_ends_every_wait_and_wait_idle_waits_for_the_running_compile(slow: _SlowCache) -> None:
    compiler = GrammarCompiler(slow, queued=lambda: 0, max_queue=8)  # type: ignore[arg-type]
    errors: list[BaseException] = []

    async def ask(source: str) -> None:
        try:
            await compiler.compile("lark", source, "a")
        except ShuttingDown as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, "s0")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(ask, "s1")
        await _until(lambda: compiler.stats.running == 1 and compiler.stats.waiting == 1)
        compiler.stop()
    assert len(errors) == 2
    with pytest.raises(ShuttingDown):
        await compiler.compile("lark", "s2", "a")
    assert not await compiler.wait_idle(0.05)  # s0 still runs
    slow.release.set()
    assert await compiler.wait_idle(10)
    assert slow.built == ["s0"]
