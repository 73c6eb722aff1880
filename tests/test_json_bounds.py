"""JSON constraints made finite (``server.api.json_bounds``), without a model: which objects
are closed, that closing only narrows a schema, that every result still compiles, and the
bounds of ``json_object``."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import llguidance
import pytest

from server.api.json_bounds import JSON_OBJECT, MAX_DEPTH, MAX_ITEMS, MAX_KEYS, closed_objects
from server.engine.grammar import JSON_OPTIONS
from tests.test_structured import SCHEMAS

PERSON: dict[str, Any] = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}


def compiles(schema: Any) -> bool:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    assert not is_error, messages
    return True


def test_an_object_with_declared_properties_is_closed_and_the_input_left_alone() -> None:
    given = copy.deepcopy(PERSON)
    closed = closed_objects(given)
    assert closed == {**PERSON, "additionalProperties": False}
    assert given == PERSON
    jsonschema.validate({"name": "Ann", "age": 3}, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "Ann", "age": 3, "city": "Oslo"}, closed)


@pytest.mark.parametrize(
    "schema",
    [
        {**PERSON, "additionalProperties": True},  # the opt-out
        {**PERSON, "additionalProperties": {"type": "string"}},
        {**PERSON, "patternProperties": {"^x-": {"type": "string"}}},
        {"type": "object"},  # free-form: nothing declared
        {"type": "object", "required": ["a"]},
        {"type": "string"},
        True,
    ],
    ids=["true", "a-schema", "pattern", "free-form", "required-only", "not-an-object", "boolean"],
)
def test_objects_that_say_what_else_they_allow_are_left_as_written(schema: Any) -> None:
    assert closed_objects(schema) == schema


def test_nested_objects_arrays_and_definitions_are_closed() -> None:
    schema = {
        "$defs": {"Pet": {"type": "object", "properties": {"kind": {"type": "string"}}}},
        "type": "object",
        "properties": {
            "owner": PERSON,
            "pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}},
            "maybe": {"anyOf": [PERSON, {"type": "null"}]},  # pydantic's Optional
        },
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["owner"]["additionalProperties"] is False
    assert closed["$defs"]["Pet"]["additionalProperties"] is False
    assert closed["properties"]["maybe"]["anyOf"][0]["additionalProperties"] is False
    assert compiles(closed)


def test_objects_whose_properties_meet_others_are_left_open() -> None:
    base = {"type": "object", "properties": {"a": {"type": "string"}}}
    more = {"type": "object", "properties": {"b": {"type": "string"}}}
    schema = {
        "$defs": {"Base": base, "Wrapped": more},
        "type": "object",
        "properties": {
            "both": {"allOf": [{"$ref": "#/$defs/Base"}, more]},  # an intersection: no part closes
            "extended": {"$ref": "#/$defs/Base", "properties": {"c": {"type": "integer"}}},
            "wrapped": {"allOf": [{"$ref": "#/$defs/Wrapped"}], "description": "pydantic v1's wrapper"},
            "mixed": {**base, "anyOf": [more, {"type": "object"}]},
        },
    }
    closed = closed_objects(schema)
    props = closed["properties"]
    assert "additionalProperties" not in closed["$defs"]["Base"]
    assert "additionalProperties" not in props["both"]["allOf"][1]
    assert "additionalProperties" not in props["extended"]
    assert "additionalProperties" not in props["mixed"] and "additionalProperties" not in props["mixed"]["anyOf"][0]
    assert closed["$defs"]["Wrapped"]["additionalProperties"] is False  # a lone wrapper is just its member
    assert compiles(closed)
    instance = {"both": {"a": "x", "b": "y"}, "extended": {"a": "x", "c": 1}, "wrapped": {"b": "z"}, "mixed": {"a": ""}}
    jsonschema.validate(instance, closed)


def test_a_chain_of_refs_is_left_open_along_all_of_its_length() -> None:
    # d0 meets d1's properties through its $ref, d1 is d2's, and so on: every definition along
    # the chain stays open, however long (each merge walks only the part it changes).
    n = 5000
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs["d0"] = {"type": "object", "properties": {"a": {"type": "string"}}, "$ref": "#/$defs/d1"}
    defs[f"d{n}"] = {"type": "object", "properties": {"b": {"type": "string"}}}
    defs["apart"] = {"type": "object", "properties": {"c": {"type": "string"}}}
    closed = closed_objects({"$defs": defs, "$ref": "#/$defs/d0"})
    assert (
        "additionalProperties" not in closed["$defs"][f"d{n}"] and "additionalProperties" not in closed["$defs"]["d0"]
    )
    assert closed["$defs"]["apart"]["additionalProperties"] is False  # off the chain: closed


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_closing_changes_nothing_where_the_schema_already_says(name: str) -> None:
    assert closed_objects(SCHEMAS[name]) == SCHEMAS[name]


def test_json_object_is_bounded_in_keys_items_and_depth() -> None:
    assert compiles(JSON_OBJECT)
    nested: Any = 1
    for _ in range(MAX_DEPTH - 1):  # inside the answer's own object: MAX_DEPTH containers in all
        nested = {"k": nested}
    jsonschema.validate({"deep": nested, "list": list(range(MAX_ITEMS)), "s": "x", "n": None}, JSON_OBJECT)
    for bad in (
        {f"k{i}": i for i in range(MAX_KEYS + 1)},
        {"list": list(range(MAX_ITEMS + 1))},
        {"deep": {"k": nested}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, JSON_OBJECT)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([1], JSON_OBJECT)
