"""Anthropic's Messages API request (``POST /v1/messages`` and ``/v1/messages/count_tokens``):
its models, and its translation into the internal request (``schema.ChatCompletionRequest``)
that ``prepare.prepare_request`` takes. No prompt building, sampling or constraints here.

Validated strictly: the top level as chat's (unknown fields refused unless
``IGNORABLE_FIELDS``; ``unsupported`` names values not done), content blocks, tools and
their choice with every field known. Blocks other than ``text``, ``tool_use`` and
``tool_result`` (images, documents, thinking) are refused, never dropped; ``cache_control``
(a caching hint) is accepted and not needed: prefixes are cached anyway.

Agent clients start the system prompt with a block ``x-anthropic-billing-header: ...`` that
changes with every request; it would make every prompt differ from its first tokens and defeat
prefix caching, and it says nothing to the model, so it is left out of the prompt.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from server.api import schema
from server.api.errors import ApiError
from server.api.lazy import build_models
from server.api.preflight import validate

BILLING_HEADER = "x-anthropic-billing-header:"
# Request fields that do not change the answer, accepted and not used: caching, routing, speed
# and attribution hints for Anthropic's own service.
IGNORABLE_FIELDS = frozenset(
    {"cache_control", "service_tier", "inference_geo", "speed", "user_profile_id", "workspace_id"}
)
# Where an error from the internal request's preparation points, in this API's terms.
PARAM_NAMES = (
    (r"messages.*", "messages"),  # the messages are not Anthropic's one for one
    (r"stop", "stop_sequences"),
    (r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
    (r"tools\[(\d+)\]\.function", r"tools[\1]"),
    (r"tool_choice\.function", "tool_choice"),
    (r"response_format\.json_schema\.schema", "output_config.format.schema"),
    (r"response_format", "output_config.format"),
)


_Known = schema.Known

CacheControl = dict[str, Any] | None  # a caching hint: accepted, not needed
Id = Annotated[str, Field(min_length=1, max_length=256)]


class TextBlock(_Known):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: Annotated[list[Any], Field(max_length=0)] | None = None


class ToolUseBlock(_Known):
    type: Literal["tool_use"]
    id: Id
    name: schema.FunctionName
    input: dict[str, Any]
    cache_control: CacheControl = None
    caller: dict[str, Any] | None = None  # who called it: information about the call


class ToolResultBlock(_Known):
    type: Literal["tool_result"]
    tool_use_id: Id
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    cache_control: CacheControl = None


_BLOCKS: dict[str, type[BaseModel]] = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock}


class MessageParam(_Known):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ToolDef(_Known):
    name: schema.FunctionName
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: CacheControl = None


class ToolChoice(_Known):
    type: Literal["auto", "any", "tool", "none"]
    name: schema.FunctionName | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Known):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None


class OutputFormat(_Known):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Known):
    format: OutputFormat | None = None
    effort: str | None = None


class Metadata(_Known):
    user_id: str | None = None


class CountTokensRequest(schema._Request):
    """What ``/v1/messages/count_tokens`` takes: the prompt's parts."""

    model: str
    messages: Annotated[list[MessageParam], Field(min_length=1, max_length=schema.MAX_MESSAGES)]
    system: str | list[dict[str, Any]] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=schema.MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # Known, and not done: refused when set.
    mcp_servers: Any = None
    container: Any = None
    context_management: Any = None

    def unsupported(self) -> str | None:
        """The first field set to something this server does not do, or None."""
        for name in self.model_extra or {}:
            if name not in IGNORABLE_FIELDS:
                return name
        refused = {
            "thinking": self.thinking is not None and self.thinking.type != "disabled",
            "output_config.effort": self.output_config is not None and self.output_config.effort is not None,
            "mcp_servers": bool(self.mcp_servers),
            "container": self.container is not None,
            "context_management": self.context_management is not None,
        }
        return next((name for name, set_ in refused.items() if set_), None)


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: schema.Probability | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: Metadata | None = None


def internal_request(req: CountTokensRequest) -> schema.ChatCompletionRequest:
    """The internal request for ``req`` (a count-tokens request: its prompt only)."""
    messages: list[dict[str, Any]] = []
    system = _system(req.system)
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        messages.extend(_messages(message, i))
    fields: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools is not None:
        fields["tools"] = [_tool(raw, i) for i, raw in enumerate(req.tools)]
    if req.tool_choice is not None:
        fields.update(_tool_choice(req.tool_choice))
    if req.output_config is not None and req.output_config.format is not None:
        schema_ = req.output_config.format.json_schema
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema_}}
    if isinstance(req, MessagesRequest):
        fields.update(
            max_tokens=req.max_tokens,
            stop=req.stop_sequences,
            stream=req.stream,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
        )
    try:
        return validate(schema.ChatCompletionRequest, {k: v for k, v in fields.items() if v is not None})
    except ApiError as exc:
        raise exc.renamed(PARAM_NAMES) from None


def _system(system: str | list[dict[str, Any]] | None) -> str:
    """The system prompt's text, without the per-request billing-header block."""
    if system is None or isinstance(system, str):
        return system or ""
    texts = []
    for i, raw in enumerate(system):
        block = _block(raw, f"system[{i}]", {"text"})
        assert isinstance(block, TextBlock)
        if not block.text.startswith(BILLING_HEADER):
            texts.append(block.text)
    return "\n".join(texts)


def _block(raw: dict[str, Any], param: str, kinds: set[str]) -> BaseModel:
    kind = raw.get("type")
    if not isinstance(kind, str) or kind not in kinds:
        allowed = ", ".join(sorted(kinds))
        message = f"{param}: content blocks of type {kind!r} are not supported here ({allowed} are)"
        raise ApiError(400, message, param=f"{param}.type", code="unsupported_parameter")
    return validate(_BLOCKS[str(kind)], raw, param)


def _messages(message: MessageParam, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as internal messages: a user's tool results become tool messages
    (in their place among its text); an assistant's text and tool uses one message."""
    param = f"messages[{i}].content"
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "assistant":
        texts, calls = [], []
        for j, raw in enumerate(message.content):
            block = _block(raw, f"{param}[{j}]", {"text", "tool_use"})
            if isinstance(block, ToolUseBlock):
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append(
                    {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}
                )
            else:
                assert isinstance(block, TextBlock)
                texts.append(block.text)
        entry: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
        if calls:
            entry["tool_calls"] = calls
        return [entry]
    out: list[dict[str, Any]] = []
    texts = []
    for j, raw in enumerate(message.content):
        block = _block(raw, f"{param}[{j}]", {"text", "tool_result"})
        if isinstance(block, ToolResultBlock):
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result(block, f"{param}[{j}]")})
        else:
            assert isinstance(block, TextBlock)
            texts.append(block.text)
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _result(block: ToolResultBlock, param: str) -> str:
    """A tool result's text; an error's says so."""
    if block.content is None or isinstance(block.content, str):
        text = block.content or ""
    else:
        parts = [_block(raw, f"{param}.content[{k}]", {"text"}) for k, raw in enumerate(block.content)]
        text = "\n".join(part.text for part in parts if isinstance(part, TextBlock))
    return f"Error: {text}" if block.is_error else text


def _tool(raw: dict[str, Any], i: int) -> dict[str, Any]:
    kind = raw.get("type", "custom")
    if kind != "custom":
        message = f"tools of type {kind!r} (server and built-in tools) are not supported; only custom tools are"
        raise ApiError(400, message, param=f"tools[{i}].type", code="unsupported_parameter")
    tool = validate(ToolDef, raw, f"tools[{i}]")
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoice) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    if choice.type == "tool":
        if choice.name is None:
            raise ApiError(
                400, "tool_choice of type 'tool' needs a name", param="tool_choice.name", code="invalid_value"
            )
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        if choice.name is not None:  # Anthropic takes a name with type "tool" only
            message = f"tool_choice of type {choice.type!r} takes no name; a named tool is type 'tool'"
            raise ApiError(400, message, param="tool_choice.name", code="invalid_value")
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return fields


build_models(globals())
