"""OpenAI's Responses API answer: the ``response`` object, its output items (a ``message``
with ``output_text``, ``function_call`` items) and usage, for a whole answer and for the
events of a stream (``responses_stream``). Pure: no IO."""

from __future__ import annotations

import time
from typing import Any

from server.api import tools
from server.api.responses_parse import ResponsesRequest, new_id
from server.engine import Usage

DEFAULT_TEMPERATURE = 1.0  # what a request without one gets (``prepare.DEFAULT_TEMPERATURE``)


def head(req: ResponsesRequest, id_: str, model: str) -> dict[str, Any]:
    """The fields of the response object that come from its request, status and output left
    to ``response``."""
    text_format = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
    return {
        "id": id_,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "background": False,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": req.stored,
        "temperature": DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
        "text": {"format": text_format or {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": [_tool(tool) for tool in req.tools or ()],
        "top_logprobs": 0,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "user": req.user,
    }


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"description": None, "parameters": None, "strict": None, **tool}


def response(
    head: dict[str, Any],
    status: str,
    output: list[dict[str, Any]],
    usage: Usage | None,
    error: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The response object: ``status`` is in_progress, completed, incomplete (cut at
    ``max_output_tokens``) or failed (with ``error``)."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        **head,
        "status": status,
        "error": error,
        "incomplete_details": incomplete,
        "output": output,
        "usage": None if usage is None else usage_object(usage),
    }


def usage_object(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(id_: str, status: str, text: str | None) -> dict[str, Any]:
    """An assistant message; ``text`` None: not begun (no content part yet)."""
    content = [] if text is None else [text_part(text)]
    return {"type": "message", "id": id_, "status": status, "role": "assistant", "content": content}


def call_item(id_: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": id_,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def status_of(finish: str) -> str:
    """A response's (and its last item's) status after an answer that ended with ``finish``."""
    return "incomplete" if finish == "length" else "completed"


def whole_output(text: str, finish: str, scheme: str | None) -> list[dict[str, Any]]:
    """The output items of a whole answer: its text as one message, or, from a tool-using
    answer (``scheme``, ``api/tools.py``), its response text and its calls."""
    status = status_of(finish)
    if not scheme:
        return [message_item(new_id("msg"), status, text)]
    answer = tools.read_answer(text, native=scheme == "native")
    items = []
    if answer.content or not answer.calls:
        items.append(message_item(new_id("msg"), status, answer.content))
    for name, arguments in answer.calls:
        items.append(call_item(new_id("fc"), tools.call_id(), name, arguments, status))
    return items


def context_of(stored: dict[str, Any]) -> list[dict[str, Any]]:
    """A stored response's output as input items for the response that continues it (only
    what a conversation carries: the messages and the calls)."""
    kept = []
    for item in stored["output"]:
        if item["type"] == "message":
            parts = [{"type": "output_text", "text": part["text"]} for part in item["content"]]
            kept.append({**item, "content": parts})
        elif item["type"] == "function_call":
            kept.append(item)
    return kept
