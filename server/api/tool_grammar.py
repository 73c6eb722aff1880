"""The grammar side of tool calls (``tools`` has the answer's reading): the JSON Schema of an
answer in the generic scheme (``output_schema``: a response or calls, each call one of the
tools by name with its parameters) and the Lark grammar of a native answer (``native_grammar``:
text, or calls written in the model's own syntax). A tool's parameters that refer to their own
parts are moved to the document's ``$defs`` with their references rewritten, so that each
still means its own. Pure: no IO, no engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from server.api.tools import CALLS_KEY, NATIVE_CLOSE, NATIVE_OPEN, RESPONSE_KEY

# JSON inside a native call as the generic scheme writes it, so that one parser reads both.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: Mapping[str, Any]


def output_schema(tools: Sequence[ToolSpec], *, calls_only: bool, parallel: bool) -> dict[str, Any]:
    """The JSON Schema of an answer: a response or calls (or calls only)."""
    call, defs = _call_schema(tools)
    calls: dict[str, Any] = {"type": "array", "items": call}
    calls["minItems"] = 1
    if not parallel:
        calls["maxItems"] = 1
    calls_answer = {
        "type": "object",
        "properties": {CALLS_KEY: calls},
        "required": [CALLS_KEY],
        "additionalProperties": False,
    }
    if calls_only:
        return {**calls_answer, **defs}
    response_answer = {
        "type": "object",
        "properties": {RESPONSE_KEY: {"type": "string"}},
        "required": [RESPONSE_KEY],
        "additionalProperties": False,
    }
    return {"anyOf": [response_answer, calls_answer], **defs}


def _call_schema(tools: Sequence[ToolSpec]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The JSON Schema of one call (one of the tools by name, with its parameters), and what
    the document that holds it must have at its root: the parameters that refer to parts of
    themselves (``"$ref": "#/$defs/Unit"``, as Pydantic writes nested models), moved to the
    root's ``$defs`` with their references rewritten, so that each still means its own."""
    defs: dict[str, Any] = {}
    items = []
    for i, tool in enumerate(tools):
        arguments: dict[str, Any] = dict(tool.parameters)
        if "$id" not in arguments and _refers_to_itself(arguments):
            key = f"llama_trio_tool_{i}"
            defs[key] = _rebased(arguments, f"#/$defs/{key}")
            arguments = {"$ref": f"#/$defs/{key}"}
        items.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    call = {"anyOf": items} if len(items) > 1 else items[0]
    return call, ({"$defs": defs} if defs else {})


# Keywords whose values are data, not schemas: a "$ref" inside them is left as it is.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _is_local(ref: Any) -> bool:
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


def _refers_to_itself(node: Any) -> bool:
    if isinstance(node, list):
        return any(_refers_to_itself(item) for item in node)
    if not isinstance(node, dict):
        return False
    return any(
        (key == "$ref" and _is_local(value)) or (key not in _DATA_KEYWORDS and _refers_to_itself(value))
        for key, value in node.items()
    )


def _rebased(node: Any, base: str) -> Any:
    """``node`` with each JSON-pointer ``$ref`` in it made relative to ``base`` (where the
    schema now sits in the document)."""
    if isinstance(node, list):
        return [_rebased(item, base) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref" and _is_local(value):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebased(value, base)
    return out


def native_grammar(tools: Sequence[ToolSpec], *, calls_only: bool, parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) of a native answer: text without a tool call, or
    calls (only calls with ``calls_only``; one with ``parallel`` false)."""
    call, defs = _call_schema(tools)
    call_schema = {**call, **defs, "x-guidance": _COMPACT}
    lines = [
        "start: " + ("calls" if calls_only else "TEXT | calls"),
        "calls: call" + (' ("\\n" call)*' if parallel else ""),
        f"call: {json.dumps(NATIVE_OPEN)} %json {json.dumps(call_schema)} {json.dumps(NATIVE_CLOSE)}",
        "TEXT: /" + _text_without(NATIVE_OPEN.strip()).replace("/", "\\/") + "/",
    ]
    return "\n".join(lines)


def _text_without(word: str) -> str:
    """A regex of any text in which ``word`` does not occur (its first character occurs in it
    only there): text without that character, then pieces that each start with it and do not
    go on into the rest of ``word``."""
    head, rest = re.escape(word[0]), word[1:]

    def piece(rest: str) -> str:
        # What may follow ``head`` (up to the next ``head``) without spelling ``rest``.
        first = re.escape(rest[0])
        avoid = f"[^{head}{first}][^{head}]*"
        return f"(?:{avoid})?" if len(rest) == 1 else f"(?:{avoid}|{first}{piece(rest[1:])})?"

    return f"[^{head}]*(?:{head}{piece(rest)})*"
