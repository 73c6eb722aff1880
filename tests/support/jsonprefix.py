"""Whether a text is the beginning of some JSON text: what an answer that a JSON grammar shaped
and ``max_tokens`` cut short must be, whatever was sampled.

``close_json(prefix)`` appends what its scan says is missing (the rest of an escape, a number
or a literal, a closing quote, a value for a key, the closing brackets); ``parse_prefix`` parses
the result. The check is sound: the prefix itself is never changed, so text that begins no JSON
text cannot parse, whatever the scan appends.
"""

from __future__ import annotations

import json
from typing import Any

_LITERALS = ("true", "false", "null")


def close_json(prefix: str) -> str:
    """``prefix`` followed by a closing that makes it a whole JSON text, when it begins one."""
    stack: list[str] = []  # the open containers, "{" or "["
    last = ""  # the last thing outside strings: "{", "[", ",", ":", "key" or "value"
    in_string = key = False
    escape = ""  # an escape in progress: "\\", or "\\u" and the hex digits so far
    scalar = ""  # a number or literal in progress
    for ch in prefix:
        if in_string:
            if escape:
                escape += ch
                if escape[1] != "u" or len(escape) == 6:
                    escape = ""
            elif ch == "\\":
                escape = ch
            elif ch == '"':
                in_string, last = False, "key" if key else "value"
            continue
        if scalar and (ch in ' \t\r\n{}[],:"'):
            scalar, last = "", "value"
        if ch in " \t\r\n":
            continue
        if ch in "{[":
            stack.append(ch)
            last = ch
        elif ch in "}]":
            if stack:
                stack.pop()
            last = "value"
        elif ch in ",:":
            last = ch
        elif ch == '"':
            in_string, key = True, bool(stack) and stack[-1] == "{" and last in ("{", ",")
        else:
            scalar += ch
    suffix = ""
    if in_string:
        suffix += ("n" if escape == "\\" else "0" * (6 - len(escape)) if escape else "") + '"'
        last = "key" if key else "value"
    elif scalar:
        literal = next((word for word in _LITERALS if word.startswith(scalar)), None)
        suffix += literal[len(scalar) :] if literal else "0" if scalar[-1] in "-+.eE" else ""
        last = "value"
    if last == "key":
        suffix += ": 0"
    elif last == ":" or (last == "," and stack and stack[-1] == "["):
        suffix += "0"
    elif last == ",":
        suffix += '"": 0'
    elif not last:
        suffix += "null"
    return prefix + suffix + "".join("}" if c == "{" else "]" for c in reversed(stack))


def parse_prefix(prefix: str) -> Any:
    """The JSON value ``prefix`` begins, closed as ``close_json`` closes it; fails (an
    AssertionError naming the text) when ``prefix`` begins no JSON text."""
    closed = close_json(prefix)
    try:
        return json.loads(closed)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"not the beginning of a JSON text: {prefix!r} ({exc}; closed as {closed!r})") from None
