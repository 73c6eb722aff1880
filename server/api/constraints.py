"""What the output must follow: a request's ``response_format``, ``json_schema`` or ``grammar``
(structured outputs), or its ``tools`` (tool calls, ``tools.output_schema``), as a compiled
``Grammar`` for the engine. Every problem is a 400 naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import trio

from server.api import schema, tools
from server.api.errors import ApiError
from server.engine.grammar import Grammar, GrammarError, GrammarKind
from server.state import ServerState

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
    if isinstance(choice, schema.NamedToolChoice) and choice.function.name not in names:
        message = f"tool_choice names {choice.function.name!r}, which is not among the tools"
        raise ApiError(400, message, param="tool_choice.function.name", code="invalid_value")
    if choice == "none":
        return ToolUse(None, False, native)
    if native:
        template_tools = [tool.model_dump(exclude_none=True) for tool in req.tools]
        return ToolUse(None, True, True, template_tools)
    return ToolUse(tools.instruction(_specs(req), calls_only=choice is not None and choice != "auto"), True)


def _specs(req: schema.ChatCompletionRequest) -> list[tools.ToolSpec]:
    choice = req.tool_choice
    chosen = [
        tool
        for tool in req.tools or ()
        if not isinstance(choice, schema.NamedToolChoice) or tool.function.name == choice.function.name
    ]
    return [
        tools.ToolSpec(tool.function.name, tool.function.description or "", tool.function.parameters or NO_PARAMETERS)
        for tool in chosen
    ]


async def output_grammar(state: ServerState, req: schema.CommonFields, use: ToolUse | None) -> Grammar | None:
    """The grammar the output must follow, compiled (or from the cache), or None.

    *Cancellation*: a compile in progress is waited for, never abandoned.
    """
    spec = _grammar_spec(req, use)
    if spec is None:
        return None
    kind, source, param = spec
    if len(source) > schema.MAX_GRAMMAR_CHARS:
        message = f"the grammar is larger than {schema.MAX_GRAMMAR_CHARS} characters"
        raise ApiError(400, message, param=param, code="invalid_value")
    grammars = await state.grammars()
    try:
        return await trio.to_thread.run_sync(grammars.compile, kind, source)
    except GrammarError as exc:
        if isinstance(req, schema.ChatCompletionRequest) and param == "tools":
            param = await _bad_tool(state, req) or param
        raise ApiError(400, f"{param}: {exc}", param=param, code="invalid_value") from None


async def _bad_tool(state: ServerState, req: schema.ChatCompletionRequest) -> str | None:
    """The first tool whose parameters do not compile on their own, as a param path."""
    grammars = await state.grammars()
    for i, tool in enumerate(req.tools or ()):
        try:
            await trio.to_thread.run_sync(grammars.compile, "json_schema", _compact(tool.function.parameters or {}))
        except GrammarError:
            return f"tools[{i}].function.parameters"
    return None


def _grammar_spec(req: schema.CommonFields, use: ToolUse | None) -> tuple[GrammarKind, str, str] | None:
    """(kind, source, param) of the request's constraint, from whichever field asked for one."""
    specs: list[tuple[GrammarKind, str, str]] = []
    form = req.response_format
    if form is not None and form.object_schema is not None and form.type != "json_object":
        message = "response_format.schema goes with type json_object (json_schema's goes in json_schema.schema)"
        raise ApiError(400, message, param="response_format.schema", code="invalid_value")
    if form is not None and form.type == "json_object":
        shape = '{"type": "object"}' if form.object_schema is None else _compact(form.object_schema)
        specs.append(("json_schema", shape, "response_format"))
    elif form is not None and form.type == "json_schema":
        if form.json_schema is None or form.json_schema.json_schema is None:
            param = "response_format.json_schema" + (".schema" if form.json_schema is not None else "")
            raise ApiError(400, f"{param} is required for type json_schema", param=param, code="invalid_value")
        specs.append(("json_schema", _compact(form.json_schema.json_schema), "response_format.json_schema.schema"))
    if req.json_schema is not None:
        specs.append(("json_schema", _compact(req.json_schema), "json_schema"))
    if req.grammar is not None:
        specs.append(("gbnf", req.grammar, "grammar"))
    if use is not None and use.constrained:
        assert isinstance(req, schema.ChatCompletionRequest)
        choice = req.tool_choice
        calls_only = choice is not None and choice != "auto"
        parallel = req.parallel_tool_calls is not False and not isinstance(choice, schema.NamedToolChoice)
        if use.native:
            specs.append(("lark", tools.native_grammar(_specs(req), calls_only=calls_only, parallel=parallel), "tools"))
        else:
            answer = tools.output_schema(_specs(req), calls_only=calls_only, parallel=parallel)
            specs.append(("json_schema", _compact(answer), "tools"))
    if len(specs) > 1:
        names = ", ".join(param for _, _, param in specs)
        message = f"give one output constraint, not several ({names})"
        raise ApiError(400, message, param=specs[1][2], code="invalid_value")
    return specs[0] if specs else None


def _compact(value: Any) -> str:
    # Key order stays: it is the order in which the output's properties come.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
