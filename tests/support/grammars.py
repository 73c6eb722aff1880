"""Schemas and grammars of a chosen size, for the tests of the bounds on grammars: chains of
``$ref``, of objects, of ``anyOf``, of GBNF and Lark rules, and objects of many properties."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def chain(body: Callable[[int], dict[str, Any]], n: int) -> dict[str, Any]:
    """$defs d0..dn, each made by ``body`` (which refers to the next), dn a string."""
    defs: dict[str, Any] = {f"d{i}": body(i) for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def ref(i: int) -> dict[str, str]:
    return {"$ref": f"#/$defs/d{i}"}


def ref_chain(n: int) -> dict[str, Any]:
    return chain(lambda i: ref(i + 1), n)


def properties_chain(n: int) -> dict[str, Any]:
    return chain(lambda i: {"type": "object", "properties": {"a": ref(i + 1)}, "required": ["a"]}, n)


def any_of_chain(n: int) -> dict[str, Any]:
    return chain(lambda i: {"anyOf": [ref(i + 1), {"type": "null"}]}, n)


def gbnf_chain(rules: int) -> str:
    """``rules`` GBNF rules, each the next one, the last "x"."""
    n = rules - 2
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "x"\n'


def lark_chain(rules: int) -> str:
    n = rules - 2
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def optional_properties(n: int, required: int = 0) -> dict[str, Any]:
    names = [f"p{i}" for i in range(n)]
    return {"type": "object", "properties": {p: {"type": "integer"} for p in names}, "required": names[:required]}


def big_schema(tag: str) -> dict[str, Any]:
    """A schema near the bounds, its own for each ``tag`` (no cache serves it): 3 objects of
    2,000 required properties (~200 KB, 6,004 subschemas), a few hundred milliseconds to compile."""
    objects = {f"{tag}o{j}": optional_properties(2000, required=2000) for j in range(3)}
    return {"type": "object", "properties": objects, "required": list(objects)}
