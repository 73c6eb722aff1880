"""Tool calls, two ways. On any chat template (the generic scheme): the tools described in a
system instruction, the answer constrained to one JSON shape, and that JSON turned back into
OpenAI's ``tool_calls``. On a template that knows tools in the Hermes/Qwen style (its text
writes ``<tool_call>``; the native scheme): the template renders the tools and the history
itself, and the model's own syntax is parsed, each call's JSON constrained by its tool.

The model answers with exactly one of (compact JSON, as the grammar writes it)::

    {"response": "<text for the user>"}
    {"tool_calls": [{"name": "<tool>", "arguments": {<the tool's parameters>}}, ...]}

``tool_grammar.output_schema`` builds the JSON Schema of that answer from the request's tools and
``tool_choice`` (``required``: calls only; a named function: one call to it; ``auto``: either;
``parallel_tool_calls: false``: at most one call), so a call's arguments always validate
against its tool's parameters. ``AnswerParser`` reads the answer as it is generated and yields
content text and call deltas, which the API streams as OpenAI does. ``conversation`` rewrites a
history with tool calls and tool results into messages any template can render.

Native answers are text, or calls each written as ``<tool_call>\n{"name": ..., "arguments":
...}\n</tool_call>`` (``tool_grammar.native_grammar``, ``NativeAnswerParser``).

Everything here is pure: no IO, no engine.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.api.tool_grammar import ToolSpec

RESPONSE_KEY = "response"
CALLS_KEY = "tool_calls"
# The answer's beginnings, as the grammar writes them (", " and ": " separators).
_RESPONSE_OPEN = '{"response": "'
_CALLS_OPEN = '{"tool_calls": ['
_CALL_OPEN = '{"name": "'
_ARGUMENTS_OPEN = '", "arguments": '


def instruction(tools: Sequence[ToolSpec], *, calls_only: bool) -> str:
    """The system instruction that tells the model about the tools and the answer's shape."""
    lines = ["You can call these tools (functions):"]
    for tool in tools:
        lines.append(f"- {tool.name}: {tool.description or 'no description'}")
        lines.append(f"  parameters (JSON Schema): {json.dumps(tool.parameters, ensure_ascii=False)}")
    calls = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}'
    if calls_only:
        lines.append(f"Answer only with a call, as JSON: {calls}")
    else:
        lines.append(
            'Answer with JSON: {"response": "<your answer to the user>"} when no tool is needed, '
            f"or {calls} to call tools; a tool's result comes back in a later message."
        )
    return "\n".join(lines)


def conversation(messages: Sequence[Mapping[str, Any]], system_extra: str | None) -> list[dict[str, str]]:
    """``messages`` (role, content, tool_calls, tool_call_id, name) as plain role/content
    messages for a template that knows no tools: an assistant's calls become the JSON it would
    have answered with (a plain account of them when no tools are on offer), a tool's result a
    user message that names the call; ``system_extra`` (the tool instruction) joins the first
    system message, or becomes one."""
    names = {}
    out: list[dict[str, str]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                names[call["id"]] = call["name"]
                calls.append({"name": call["name"], "arguments": _json_or_text(call["arguments"])})
            if system_extra is not None:  # the answer's own shape, as the model will write it
                content = json.dumps({CALLS_KEY: calls}, ensure_ascii=False, separators=(", ", ": "))
            else:  # no tools on offer now (tool_choice "none"): told, not shown as a format
                content = "; ".join(
                    f"(called {c['name']} with {json.dumps(c['arguments'], ensure_ascii=False)})" for c in calls
                )
        elif role == "assistant" and system_extra is not None:
            content = json.dumps({RESPONSE_KEY: content}, ensure_ascii=False, separators=(", ", ": "))
        elif role == "tool":
            call_id = message.get("tool_call_id", "")
            name = names.get(call_id) or message.get("name") or "a tool"
            role, content = "user", f"Result of {name} (call {call_id}): {content}"
        out.append({"role": role, "content": content, **_name_of(message)})
    return out if system_extra is None else with_system_note(out, system_extra)


def with_system_note(messages: list[dict[str, Any]], note: str) -> list[dict[str, Any]]:
    """``messages`` with ``note`` joined to the first system message, or as one of its own."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{note}".strip()}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def _name_of(message: Mapping[str, Any]) -> dict[str, str]:
    """A participant's ``name`` (not a tool's, which names the call's function) to keep."""
    return {"name": message["name"]} if message.get("name") and message["role"] != "tool" else {}


def _json_or_text(arguments: str) -> Any:
    """A call's ``arguments`` as JSON for the template, or as the text given when that text is
    not JSON (or is nested past what the parser's recursion allows: a short string can be)."""
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments


# -- the native scheme --------------------------------------------------------------------------

NATIVE_OPEN = "<tool_call>\n"
NATIVE_CLOSE = "\n</tool_call>"


def knows_tools(template_source: str) -> bool:
    """Whether a chat template writes tool calls in the Hermes/Qwen syntax."""
    return "<tool_call>" in template_source and "tools" in template_source


def native_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` in the form tool-aware templates read (Hugging Face's convention): an
    assistant's ``tool_calls`` with ``function.arguments`` as an object, a tool message with
    its ``tool_call_id`` and ``name``."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for message in messages:
        entry: dict[str, Any] = {"role": message["role"], "content": message.get("content") or "", **_name_of(message)}
        if message.get("tool_calls"):
            entry["tool_calls"] = []
            for call in message["tool_calls"]:
                names[call["id"]] = call["name"]
                function = {"name": call["name"], "arguments": _json_or_text(call["arguments"])}
                entry["tool_calls"].append({"id": call["id"], "type": "function", "function": function})
        if message["role"] == "tool":
            entry["tool_call_id"] = message.get("tool_call_id")
            entry["name"] = message.get("name") or names.get(message.get("tool_call_id") or "", "")
        out.append(entry)
    return out


# -- reading the answer as it comes -------------------------------------------------------------


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    fragment: str


Event = Content | CallStart | CallArguments


class AnswerParser:
    """Reads an answer of ``output_schema``'s shape piece by piece (``feed``) and yields what
    each piece adds: response text (JSON escapes decoded), a call's start (its name complete),
    fragments of its arguments' JSON text. The grammar guarantees the shape; an answer cut
    short (``max_tokens``) simply yields less. ``calls`` counts the calls started."""

    def __init__(self) -> None:
        self._buffer = ""
        self._at = 0  # what of the buffer is read
        self._state = "open"
        self.calls = 0
        self._depth = 0  # inside a call's arguments: nesting, string and escape state
        self._in_string = False
        self._escaped = False
        self._name_start = 0

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            before = (self._state, self._at)
            handler = getattr(self, f"_{self._state}")
            handler(events)
            if (self._state, self._at) == before:
                return events

    def _open(self, events: list[Event]) -> None:
        rest = self._buffer[self._at :]
        if rest.startswith(_RESPONSE_OPEN):
            self._at += len(_RESPONSE_OPEN)
            self._state = "response"
        elif rest.startswith(_CALLS_OPEN):
            self._at += len(_CALLS_OPEN)
            self._state = "call"

    def _response(self, events: list[Event]) -> None:
        text, consumed, closed = _string_prefix(self._buffer, self._at)
        if text:
            events.append(Content(text))
        self._at = consumed
        if closed:
            self._state = "done"

    def _call(self, events: list[Event]) -> None:
        if self._buffer.startswith(_CALL_OPEN, self._at):
            self._at += len(_CALL_OPEN)
            self._name_start = self._at
            self._state = "name"

    def _name(self, events: list[Event]) -> None:
        end = self._buffer.find(_ARGUMENTS_OPEN, self._name_start)
        if end < 0:
            return
        events.append(CallStart(self.calls, self._buffer[self._name_start : end]))
        self._at = end + len(_ARGUMENTS_OPEN)
        self._depth, self._in_string, self._escaped = 0, False, False
        self._state = "arguments"

    def _arguments(self, events: list[Event]) -> None:
        start = i = self._at
        buffer = self._buffer
        while i < len(buffer):
            char = buffer[i]
            i += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    events.append(CallArguments(self.calls, buffer[start:i]))
                    self.calls += 1
                    self._at = i
                    self._state = "between"
                    return
        if i > start:
            events.append(CallArguments(self.calls, buffer[start:i]))
        self._at = i

    def _between(self, events: list[Event]) -> None:
        rest = self._buffer[self._at :]
        if rest.startswith("}, "):
            self._at += 3
            self._state = "call"
        elif rest.startswith("}]"):
            self._at += 2
            self._state = "done"

    def _done(self, events: list[Event]) -> None:
        pass


class NativeAnswerParser(AnswerParser):
    """``AnswerParser`` for the native syntax: text until a ``<tool_call>`` (none in an answer
    the grammar allowed), then calls."""

    def _open(self, events: list[Event]) -> None:
        self._state = "text"

    def _text(self, events: list[Event]) -> None:
        rest = self._buffer[self._at :]
        found = rest.find(NATIVE_OPEN)
        if found >= 0:
            if found:
                events.append(Content(rest[:found]))
            self._at += found + len(NATIVE_OPEN)
            self._state = "call"
            return
        # A tail that may still become "<tool_call>\n" waits for the next piece.
        keep = next(
            (k for k in range(min(len(rest), len(NATIVE_OPEN) - 1), 0, -1) if NATIVE_OPEN.startswith(rest[-k:])), 0
        )
        if len(rest) > keep:
            events.append(Content(rest[: len(rest) - keep]))
            self._at += len(rest) - keep

    def _between(self, events: list[Event]) -> None:
        end = "}" + NATIVE_CLOSE
        if self._buffer.startswith(end, self._at):
            self._at += len(end)
            self._state = "next"

    def _next(self, events: list[Event]) -> None:
        if self._buffer.startswith("\n" + NATIVE_OPEN, self._at):
            self._at += 1 + len(NATIVE_OPEN)
            self._state = "call"


def _string_prefix(buffer: str, at: int) -> tuple[str, int, bool]:
    """Decode the JSON string body starting at ``at`` as far as it is complete: (text, where
    reading stopped, whether the closing quote was reached). An escape cut short is left for
    the next piece."""
    out: list[str] = []
    i = at
    while i < len(buffer):
        char = buffer[i]
        if char == '"':
            return "".join(out), i + 1, True
        if char != "\\":
            out.append(char)
            i += 1
            continue
        if i + 1 >= len(buffer):
            break
        if buffer[i + 1] == "u":
            if i + 6 > len(buffer):
                break
            code = int(buffer[i + 2 : i + 6], 16)
            if 0xD800 <= code < 0xDC00:  # a surrogate pair: both halves or neither
                if i + 12 > len(buffer):
                    break
                low = int(buffer[i + 8 : i + 12], 16)
                out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                i += 12
                continue
            out.append(chr(code))
            i += 6
            continue
        out.append(json.loads(f'"{buffer[i : i + 2]}"'))
        i += 2
    return "".join(out), i, False


def call_id() -> str:
    """A fresh tool-call id, in OpenAI's form."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class Answer:
    """A whole answer, read: the response text or the calls (name, arguments JSON text)."""

    content: str
    calls: list[tuple[str, str]]


def read_answer(text: str, *, native: bool = False) -> Answer:
    parser = NativeAnswerParser() if native else AnswerParser()
    content: list[str] = []
    names: list[str] = []
    arguments: list[list[str]] = []
    for event in parser.feed(text):
        if isinstance(event, Content):
            content.append(event.text)
        elif isinstance(event, CallStart):
            names.append(event.name)
            arguments.append([])
        else:
            arguments[event.index].append(event.fragment)
    return Answer("".join(content), [(name, "".join(parts)) for name, parts in zip(names, arguments, strict=True)])
