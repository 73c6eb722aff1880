"""What the output must follow: a request's ``response_format``, ``json_schema`` or ``grammar``
(structured outputs), or its ``tools`` (tool calls, ``tool_grammar.output_schema``), as a compiled
``Grammar`` for the engine. Every problem is a 400 naming the field. JSON Schemas (a
request's, a tool's parameters) have their objects closed first, and ``json_object`` is a
bounded object (``json_bounds``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from server.api import tool_grammar, tools
from server.api.errors import ApiError
from server.api.json_bounds import JSON_OBJECT, closed_objects
from server.api.lazy import deferred
from server.engine import EngineError
from server.engine.grammar import Grammar, GrammarError, GrammarKind
from server.engine.grammar_limits import TooComplex, check_schema, check_schema_text
from server.models.runtime import ModelRuntime

if TYPE_CHECKING:
    from server.api import schema
else:  # imported once the server is ready (server.api.lazy)
    schema = deferred("server.api.schema")

MAX_ERROR_CHARS = 1000  # of a compile error's message in a 400

# A function without parameters takes an empty object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolUse:
    """How a chat request uses its tools. ``native``: the template renders them and the model
    answers in its own syntax (``template_tools``, OpenAI's tool objects, go to the template);
    otherwise ``instruction`` joins the system message. ``constrained``: the answer is a
    response or calls (False for ``tool_choice: "none"``)."""

    instruction: str | None
    constrained: bool
    native: bool = False
    template_tools: list[dict[str, Any]] | None = None


def tool_use(req: schema.ChatCompletionRequest, *, native: bool) -> ToolUse | None:
    """The request's tool use, checked; None without tools. ``native``: the chat template
    knows tools (``tools.knows_tools``)."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise ApiError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
        return None
    names = [tool.function.name for tool in req.tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ApiError(
                400, f"two tools are named {name!r}", param=f"tools[{i}].function.name", code="invalid_value"
            )
    for i, tool in enumerate(req.tools):
        kind = (tool.function.parameters or {}).get("type", "object")
        if kind != "object":  # a call's arguments are an object (OpenAI and Anthropic say so)
            message = f"a tool's parameters are the JSON Schema of an object (type 'object'), not {kind!r}"
            raise ApiError(400, message, param=f"tools[{i}].function.parameters", code="invalid_value")
    if isinstance(choice, schema.NamedToolChoice) and choice.function.name not in names:
        message = f"tool_choice names {choice.function.name!r}, which is not among the tools"
        raise ApiError(400, message, param="tool_choice.function.name", code="invalid_value")
    if choice == "none":
        return ToolUse(None, False, native)
    if native:
        template_tools = [tool.model_dump(exclude_none=True) for tool in req.tools]
        return ToolUse(None, True, True, template_tools)
    return ToolUse(tools.instruction(_specs(req), calls_only=choice is not None and choice != "auto"), True)


def _specs(req: schema.ChatCompletionRequest) -> list[tool_grammar.ToolSpec]:
    choice = req.tool_choice
    chosen = [
        tool
        for tool in req.tools or ()
        if not isinstance(choice, schema.NamedToolChoice) or tool.function.name == choice.function.name
    ]
    return [
        tool_grammar.ToolSpec(tool.function.name, tool.function.description or "", _object(tool.function.parameters))
        for tool in chosen
    ]


def _object(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool's parameters that do not say their type are an object's all the same (``{}``:
    none); but not where the type comes from elsewhere (a ``$ref``, ``anyOf``...), which
    llguidance would have to intersect with, level by level."""
    if not parameters:
        return NO_PARAMETERS
    if "type" in parameters or not _TYPED_ELSEWHERE.isdisjoint(parameters):
        return parameters
    return {"type": "object", **parameters}


_TYPED_ELSEWHERE = frozenset({"$ref", "anyOf", "oneOf", "allOf", "if", "not", "const", "enum"})


async def output_grammar(
    model: ModelRuntime, req: schema.CommonFields, use: ToolUse | None, scope: str
) -> Grammar | None:
    """The grammar the output must follow, compiled (or from the cache of ``scope``: the
    request's tenant and salt, ``prepare.cache_scope``), or None. A grammar past a bound of
    ``grammar_limits`` or that llguidance refuses is a 400 naming the field; a full queue or a
    drain, a 503.

    *Cancellation*: leaves the compile queue; a compile already running finishes without us.
    """
    if not _asks_for_one(req, use):
        return None
    # A request's schemas and tools may be megabytes: walked, closed and written out in a
    # worker thread, never on the event loop.
    spec = await trio.to_thread.run_sync(_grammar_spec, req, use)
    if spec is None:
        return None
    kind, source, param = spec
    if len(source) > schema.MAX_GRAMMAR_CHARS:
        message = f"the grammar is larger than {schema.MAX_GRAMMAR_CHARS} characters"
        raise ApiError(400, message, param=param, code="invalid_value")
    compiler = await model.grammars()
    try:
        return await compiler.compile(kind, source, scope)
    except EngineError as exc:
        raise ApiError.from_engine(exc, param=param) from None
    except GrammarError as exc:
        message = str(exc)
        if isinstance(req, schema.ChatCompletionRequest) and param == "tools":
            param, message = await _bad_tool(model, req, scope) or (param, message)
        if len(message) > MAX_ERROR_CHARS:  # llguidance may quote the whole grammar
            message = message[:MAX_ERROR_CHARS] + "..."
        raise ApiError(400, f"{param}: {message}", param=param, code="invalid_value") from None


async def _bad_tool(model: ModelRuntime, req: schema.ChatCompletionRequest, scope: str) -> tuple[str, str] | None:
    """The first tool whose parameters are past a bound or do not compile on their own: its
    param path and what is wrong. The bounds are checked first, for every tool, in a worker
    thread; then each tool's parameters are compiled in turn, through the compile queue.

    *Cancellation*: as ``output_grammar``.
    """
    sources = [_compact(tool.function.parameters or {}) for tool in req.tools or ()]

    def first_too_complex() -> tuple[int, str] | None:
        for i, source in enumerate(sources):
            try:
                check_schema_text(source)
            except TooComplex as exc:
                return i, str(exc)
        return None

    too_complex = await trio.to_thread.run_sync(first_too_complex)
    if too_complex is not None:
        return f"tools[{too_complex[0]}].function.parameters", too_complex[1]
    compiler = await model.grammars()
    for i, source in enumerate(sources):
        try:
            await compiler.compile("json_schema", source, scope)
        except GrammarError as exc:
            return f"tools[{i}].function.parameters", str(exc)
        except EngineError:
            return None
    return None


def _asks_for_one(req: schema.CommonFields, use: ToolUse | None) -> bool:
    return (
        req.response_format is not None
        or req.json_schema is not None
        or req.grammar is not None
        or (use is not None and use.constrained)
    )


def _grammar_spec(req: schema.CommonFields, use: ToolUse | None) -> tuple[GrammarKind, str, str] | None:
    """(kind, source, param) of the request's constraint, from whichever field asked for one."""
    specs: list[tuple[GrammarKind, str, str]] = []
    form = req.response_format
    if form is not None and form.type == "json_object":
        if form.object_schema is not None:  # llama-server's form: the object's own schema
            closed = _closed(form.object_schema, "response_format.schema")
            specs.append(("json_schema", _compact(closed), "response_format.schema"))
        else:
            specs.append(("json_schema", _compact(JSON_OBJECT), "response_format"))
    elif form is not None and form.type == "json_schema":
        if form.json_schema is None or form.json_schema.json_schema is None:
            param = "response_format.json_schema" + (".schema" if form.json_schema is not None else "")
            raise ApiError(400, f"{param} is required for type json_schema", param=param, code="invalid_value")
        closed = _closed(form.json_schema.json_schema, "response_format.json_schema.schema")
        specs.append(("json_schema", _compact(closed), "response_format.json_schema.schema"))
    if req.json_schema is not None:
        specs.append(("json_schema", _compact(_closed(req.json_schema, "json_schema")), "json_schema"))
    if req.grammar is not None:
        specs.append(("gbnf", req.grammar, "grammar"))
    if use is not None and use.constrained:
        assert isinstance(req, schema.ChatCompletionRequest)
        choice = req.tool_choice
        calls_only = choice is not None and choice != "auto"
        parallel = req.parallel_tool_calls is not False and not isinstance(choice, schema.NamedToolChoice)
        # The instruction shows the tools' parameters as given; the grammar closes their objects.
        given = [
            dataclasses.replace(s, parameters=_closed(s.parameters, f"tools[{i}].function.parameters"))
            for i, s in enumerate(_specs(req))
        ]
        if use.native:
            specs.append(
                ("lark", tool_grammar.native_grammar(given, calls_only=calls_only, parallel=parallel), "tools")
            )
        else:
            answer = tool_grammar.output_schema(given, calls_only=calls_only, parallel=parallel)
            specs.append(("json_schema", _compact(answer), "tools"))
    if len(specs) > 1:
        names = ", ".join(param for _, _, param in specs)
        message = f"give one output constraint, not several ({names})"
        raise ApiError(400, message, param=specs[1][2], code="invalid_value")
    return specs[0] if specs else None


def _closed(value: Any, param: str) -> Any:
    """The schema ``value`` with its objects closed (``closed_objects``), checked first against
    the bounds of ``grammar_limits`` (a 400 naming ``param``): closing walks it on the event
    loop, and the bounds keep that walk short (10,000 subschemas, 128 deep). A schema whose
    text is past the grammar's bound is refused before any walk (data such as a million
    ``examples`` is not bounded by the subschemas' count)."""
    try:
        size = len(_compact(value))
    except (RecursionError, ValueError):
        size = schema.MAX_GRAMMAR_CHARS + 1
    if size > schema.MAX_GRAMMAR_CHARS:
        message = f"{param}: the schema is larger than {schema.MAX_GRAMMAR_CHARS} characters"
        raise ApiError(400, message, param=param, code="invalid_value")
    try:
        check_schema(value)
    except TooComplex as exc:
        raise ApiError(400, f"{param}: {exc}", param=param, code="invalid_value") from None
    return closed_objects(value)


def _compact(value: Any) -> str:
    # Key order stays: it is the order in which the output's properties come.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
