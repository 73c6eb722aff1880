"""OpenAI's Responses API request (``POST /v1/responses`` and ``/v1/responses/input_tokens``):
its models, and its translation into the internal request (``schema.ChatCompletionRequest``)
that ``prepare.prepare_request`` takes. No prompt building, sampling or constraints here.

Validated strictly, as every request: the top level as chat's (unknown fields refused unless
``schema.IGNORABLE_FIELDS``, ``unsupported`` naming values not done); input items, their
content parts, tools and the text format with every field known (anything else is a 400).
Input items become messages in normalised form first (``input_items``: each with an ``id`` and
a ``status``), which is also what the store keeps and ``input_items`` lists.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from server.api import schema
from server.api.errors import ApiError
from server.api.lazy import build_models
from server.api.preflight import validate

# Where an error from the internal request's preparation points, in this API's terms.
PARAM_NAMES = (
    (r"messages.*", "input"),  # the messages are not the items one for one
    (r"response_format\.json_schema", "text.format"),
    (r"response_format", "text.format"),
    (r"tools\[(\d+)\]\.function", r"tools[\1]"),
    (r"tool_choice\.function", "tool_choice"),
    (r"max_completion_tokens", "max_output_tokens"),
)
MAX_METADATA = 16  # as OpenAI
MAX_CALL_ID = 256


_Known = schema.Known

CallId = Annotated[str, Field(min_length=1, max_length=MAX_CALL_ID)]
Status = Literal["in_progress", "completed", "incomplete"] | None


class MessageItem(_Known):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: Status = None


class FunctionCallItem(_Known):
    type: Literal["function_call"]
    call_id: CallId
    name: schema.FunctionName
    arguments: str
    id: str | None = None
    status: Status = None


class FunctionCallOutputItem(_Known):
    type: Literal["function_call_output"]
    call_id: CallId
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: Status = None


_ITEMS: dict[str, tuple[type[BaseModel], str]] = {
    "message": (MessageItem, "msg"),
    "function_call": (FunctionCallItem, "fc"),
    "function_call_output": (FunctionCallOutputItem, "fco"),
}


class FunctionTool(_Known):
    type: Literal["function"]
    name: schema.FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Known):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Known):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(_Known):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptions(_Known):
    include_obfuscation: bool | None = None  # padding against a side channel: no answer changes


class ResponsesRequest(schema._Request):
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(max_length=schema.MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: schema.Probability | None = None
    text: TextConfig | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=schema.MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: Annotated[dict[str, str], Field(max_length=MAX_METADATA)] | None = None
    user: str | None = None
    store: bool | None = None  # None: true, as OpenAI
    previous_response_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: Reasoning | None = None
    background: bool | None = None
    # Known, and not done: refused when set.
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None

    def unsupported(self) -> str | None:
        """The first field set to something this server does not do, or None."""
        for name in self.model_extra or {}:
            if name not in schema.IGNORABLE_FIELDS:
                return name
        refused = {
            "include": bool(self.include),  # logprobs, reasoning content, hosted tools' results
            "truncation": self.truncation == "auto",  # a prompt too long is a 400, never cut
            "background": bool(self.background),
            "top_logprobs": bool(self.top_logprobs),
            "max_tool_calls": self.max_tool_calls is not None,
            "conversation": self.conversation is not None,
            "prompt": self.prompt is not None,
            "context_management": self.context_management is not None,
            "text.verbosity": self.text is not None and self.text.verbosity is not None,
        }
        if self.reasoning is not None:
            refused["reasoning.effort"] = self.reasoning.effort not in (None, "none")
            refused["reasoning.summary"] = (self.reasoning.summary or self.reasoning.generate_summary) is not None
        return next((name for name, set_ in refused.items() if set_), None)

    @property
    def stored(self) -> bool:
        return self.store is not False


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's ``input`` as normalised items: messages with a list of text parts,
    function calls and their outputs, each with an ``id`` (its own, or a new one)."""
    if isinstance(req.input, str):
        return [_message("user", [{"type": "input_text", "text": req.input}], None)]
    items = []
    for i, raw in enumerate(req.input):
        kind = raw.get("type", "message")
        if not isinstance(kind, str) or kind not in _ITEMS:
            message = (
                f"input items of type {kind!r} are not supported; message, function_call and function_call_output are"
            )
            raise ApiError(400, message, param=f"input[{i}].type", code="unsupported_parameter")
        model, prefix = _ITEMS[kind]
        item: Any = validate(model, raw, f"input[{i}]")
        if isinstance(item, MessageItem):
            items.append(_message(item.role, _parts(item.content, f"input[{i}].content"), item.id))
            continue
        normal = item.model_dump(exclude_none=True)
        if isinstance(item, FunctionCallOutputItem):
            normal["output"] = _text(_parts(item.output, f"input[{i}].output"))
        normal["id"] = item.id or new_id(prefix)
        normal["status"] = "completed"
        items.append(normal)
    return items


def refuse_duplicate_ids(earlier: list[dict[str, Any]], own: list[dict[str, Any]]) -> None:
    """A 400 for an input item whose id an item before it already has (in the request, or in
    the response it continues), as OpenAI refuses it: an id names one item (``input_items``
    pages by it)."""
    seen = {item["id"] for item in earlier}
    for i, item in enumerate(own):
        if item["id"] in seen:
            message = f"input[{i}].id: {item['id']!r} is already the id of an earlier item of this conversation"
            raise ApiError(400, message, param=f"input[{i}].id", code="invalid_value")
        seen.add(item["id"])


def _message(role: str, parts: list[dict[str, Any]], id_: str | None) -> dict[str, Any]:
    return {"type": "message", "id": id_ or new_id("msg"), "status": "completed", "role": role, "content": parts}


# Text content parts: a request's own, an earlier answer's sent back (``output_text``, whose
# annotations and logprobs are about that answer), and a refusal.
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
_PART_EXTRAS = {"annotations", "logprobs"}


def _parts(content: str | list[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    """Content as text parts; any other part (an image, a file, audio) is a 400."""
    if isinstance(content, str):
        return [{"type": "input_text", "text": content}]
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            message = f"content parts of type {kind!r} are not supported; only text parts are"
            raise ApiError(400, message, param=f"{param}[{j}].type", code="unsupported_parameter")
        text = part.get(key)
        extra = set(part) - {"type", key, *(_PART_EXTRAS if kind == "output_text" else ())}
        if not isinstance(text, str) or extra:
            problem = f"needs a string {key!r}" if not isinstance(text, str) else f"has unknown fields {sorted(extra)}"
            raise ApiError(400, f"{param}[{j}]: a {kind} part {problem}", param=f"{param}[{j}]", code="invalid_value")
        parts.append({"type": "output_text" if kind == "refusal" else kind, "text": text})
    return parts


def _text(parts: list[dict[str, Any]]) -> str:
    return "\n".join(part["text"] for part in parts)  # as chat's text parts are joined


def internal_request(req: ResponsesRequest, context: list[dict[str, Any]]) -> schema.ChatCompletionRequest:
    """The internal request for ``req`` over ``context`` (normalised items: a stored
    conversation's, then the request's own)."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    for item in context:
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": _text(item["content"])})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function"}
            call["function"] = {"name": item["name"], "arguments": item["arguments"]}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one turn: its text and calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "stream": req.stream,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    if req.tools is not None:
        fields["tools"] = [_tool(raw, i) for i, raw in enumerate(req.tools)]
    if req.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(req.tool_choice)
    if req.text is not None and req.text.format is not None:
        fields["response_format"] = _response_format(req.text.format)
    try:
        return validate(schema.ChatCompletionRequest, {k: v for k, v in fields.items() if v is not None})
    except ApiError as exc:
        raise exc.renamed(PARAM_NAMES) from None


def _tool(raw: dict[str, Any], i: int) -> dict[str, Any]:
    kind = raw.get("type")
    if kind != "function":
        message = f"tools of type {kind!r} (built-in tools) are not supported; only function tools are"
        raise ApiError(400, message, param=f"tools[{i}].type", code="unsupported_parameter")
    tool = validate(FunctionTool, raw, f"tools[{i}]")
    return {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}


def _tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            message = "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}"
            raise ApiError(400, message, param="tool_choice", code="invalid_value")
        return choice
    if choice.get("type") != "function":
        message = f"tool_choice of type {choice.get('type')!r} is not supported; only function tools are"
        raise ApiError(400, message, param="tool_choice.type", code="unsupported_parameter")
    if set(choice) != {"type", "name"} or not isinstance(choice["name"], str):
        message = "a function tool_choice is {'type': 'function', 'name': <a tool's name>}"
        raise ApiError(400, message, param="tool_choice", code="invalid_value")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(form: TextFormat) -> dict[str, Any]:
    if form.type != "json_schema":
        # name, description and strict belong to a json_schema; a schema with json_object is
        # the object's (as chat's response_format takes it, after llama-server); with text, none.
        extra = [key for key in ("name", "description", "strict") if getattr(form, key) is not None]
        if form.json_schema is not None and form.type == "text":
            extra.insert(0, "schema")
        if extra:
            message = f"text.format.{extra[0]} is not taken with type {form.type}"
            raise ApiError(400, message, param=f"text.format.{extra[0]}", code="unsupported_parameter")
        if form.json_schema is not None:
            return {"type": "json_object", "schema": form.json_schema}
        return {"type": form.type}
    if form.name is None or form.json_schema is None:
        missing = "name" if form.name is None else "schema"
        message = f"text.format.{missing} is required for type json_schema"
        raise ApiError(400, message, param=f"text.format.{missing}", code="invalid_value")
    json_schema: dict[str, Any] = {"name": form.name, "schema": form.json_schema}
    if form.description is not None:
        json_schema["description"] = form.description
    if form.strict is not None:
        json_schema["strict"] = form.strict
    return {"type": "json_schema", "json_schema": json_schema}


build_models(globals())
