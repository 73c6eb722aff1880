"""JSON constraints made finite before they are compiled (pure).

- ``closed_objects(schema)``: every object that declares its ``properties`` and says nothing
  of others (no ``additionalProperties``, ``patternProperties`` or ``unevaluatedProperties``)
  gets ``additionalProperties: false``, so the answer holds only the declared properties. JSON
  Schema's default allows any other key, and through clients that leave it out (instructor's
  JSON_SCHEMA mode, ``llm --schema``) a small model keeps adding keys until ``max_tokens``; an
  object with only the declared properties satisfies the schema as written, so nothing valid is
  lost that the client asked for (llama.cpp's own schema converter does the same). A schema
  that wants other keys says so: ``additionalProperties: true`` or a schema of its own. Objects
  whose properties meet others' (``allOf``, a ``$ref`` or ``anyOf``/``oneOf`` beside
  ``properties``, and the definitions such a ``$ref`` names) are left as written, since
  closing one part would forbid the other part's properties; so is an object that declares no
  properties (a free-form object).
- ``JSON_OBJECT``: ``response_format: {"type": "json_object"}`` as a bounded object: at most
  ``MAX_KEYS`` properties per object, ``MAX_ITEMS`` items per array, containers at most
  ``MAX_DEPTH`` deep, so that an answer cannot be an endless run of keys.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = (
    "additionalProperties",
    "items",
    "additionalItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keywords that already say what other properties may do.
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Keywords that join the node with other subschemas, whose properties then count too.
_JOINS = ("allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "dependentSchemas")
_COMBINATORS = ("allOf", "anyOf", "oneOf", "$ref")

MAX_KEYS = 32
MAX_ITEMS = 64
MAX_DEPTH = 4


def closed_objects(schema: Any) -> Any:
    """``schema`` with its objects closed as the module says (a new value; the one given is
    left alone)."""
    merged: set[str] = set()
    found: set[str] = set()
    nodes: dict[str, Any] = {}  # every schema the walk visits, by its path
    _walk(schema, "#", True, merged, found, nodes)
    # A merged definition may name another through its own $ref. Merging a path changes only
    # what is at and below it, so only that part is walked again: linear in a chain of $refs
    # (walking all of it again after each merge was quadratic: seconds on the event loop).
    pending = found - merged
    while pending:
        merged |= pending
        found = set()
        for ref in pending:
            if ref in nodes:
                _walk(nodes[ref], ref, False, merged, found, {})
        pending = found - merged
    return _walk(schema, "#", True, merged, set(), {})


def _walk(node: Any, path: str, closable: bool, merged: set[str], found: set[str], nodes: dict[str, Any]) -> Any:
    """``node`` (at JSON pointer ``path``) closed where it may be; ``closable``: its properties
    meet no others'. Adds to ``found`` the ``$ref`` targets whose properties meet others', and
    to ``nodes`` each schema it visits."""
    if not isinstance(node, dict):
        return node
    nodes[path] = node
    closable = closable and path not in merged
    declares = isinstance(node.get("properties"), dict)
    out = dict(node)
    if closable and declares and not any(k in node for k in (*_OPEN, *_JOINS)):
        out["additionalProperties"] = False
    ref = node.get("$ref")
    if isinstance(ref, str) and (not closable or declares or any(k in node for k in _COMBINATORS if k != "$ref")):
        found.add(ref)
    for key in _MAP:
        value = node.get(key)
        if isinstance(value, dict):
            out[key] = {
                name: _walk(sub, f"{path}/{key}/{_escape(name)}", True, merged, found, nodes)
                for name, sub in value.items()
            }
    for key in _ONE:
        if isinstance(node.get(key), dict):
            out[key] = _walk(node[key], f"{path}/{key}", True, merged, found, nodes)
    for key in _LIST:
        value = node.get(key)
        if isinstance(value, list):
            members = key not in _COMBINATORS or _members_closable(node, key)
            out[key] = [_walk(sub, f"{path}/{key}/{i}", members, merged, found, nodes) for i, sub in enumerate(value)]
    return out


def _members_closable(node: dict[str, Any], key: str) -> bool:
    """Whether the members of combinator ``key`` stand alone: no properties of the node's own
    and no other combinator meet them (one ``allOf`` member alone is a plain wrapper)."""
    if isinstance(node.get("properties"), dict) or any(k in node for k in _COMBINATORS if k != key):
        return False
    return key != "allOf" or len(node[key]) == 1


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _bounded_object() -> dict[str, Any]:
    scalars: list[dict[str, Any]] = [{"type": t} for t in ("string", "number", "boolean", "null")]
    defs: dict[str, Any] = {"value0": {"anyOf": scalars}}
    for depth in range(1, MAX_DEPTH):
        inner = {"$ref": f"#/$defs/value{depth - 1}"}
        defs[f"value{depth}"] = {
            "anyOf": [
                *scalars,
                {"type": "array", "items": inner, "maxItems": MAX_ITEMS},
                {"type": "object", "additionalProperties": inner, "maxProperties": MAX_KEYS},
            ]
        }
    return {
        "$defs": defs,
        "type": "object",
        "additionalProperties": {"$ref": f"#/$defs/value{MAX_DEPTH - 1}"},
        "maxProperties": MAX_KEYS,
    }


JSON_OBJECT = _bounded_object()
