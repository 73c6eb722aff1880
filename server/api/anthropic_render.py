"""Anthropic's Messages API answer: the ``message`` object (``text`` and ``tool_use`` content
blocks, ``stop_reason``, usage) and errors in Anthropic's shape. Pure: no IO."""

from __future__ import annotations

import json
import secrets
from typing import Any

from server.api import tools
from server.api.errors import ApiError
from server.engine import Usage

# Anthropic's error types by HTTP status (anything else: ``api_error``).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    431: "request_too_large",
    503: "overloaded_error",
}


def error_body(error: ApiError) -> dict[str, Any]:
    """``error`` as Anthropic answers one."""
    kind = _ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def message(
    id_: str, model: str, content: list[dict[str, Any]], stop: tuple[str | None, str | None], usage: Usage | None
) -> dict[str, Any]:
    """The message object; ``stop`` is (stop_reason, stop_sequence)."""
    return {
        "id": id_,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage_object(usage) if usage is not None else {"input_tokens": 0, "output_tokens": 0},
    }


def usage_object(usage: Usage) -> dict[str, int]:
    """Anthropic's counts: ``input_tokens`` are those not read from the cache."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
    }


def stop_reason(finish: str, stop_sequence: str | None, *, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an answer that ended with ``finish``."""
    if finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if stop_sequence is not None:
        return "stop_sequence", stop_sequence
    return "end_turn", None


def tool_use_block(id_: str, name: str, arguments: str) -> dict[str, Any]:
    """A call as a ``tool_use`` block; arguments cut short (``max_tokens``) are ``{}``."""
    try:
        input_ = json.loads(arguments)
    except ValueError:
        input_ = {}
    return {"type": "tool_use", "id": id_, "name": name, "input": input_}


def whole_content(text: str, scheme: str | None) -> tuple[list[dict[str, Any]], bool]:
    """A whole answer's content blocks, and whether it calls tools: its text as one block, or
    from a tool-using answer (``scheme``, ``api/tools.py``), its text and its calls."""
    if not scheme:
        return [{"type": "text", "text": text}], False
    answer = tools.read_answer(text, native=scheme == "native")
    blocks: list[dict[str, Any]] = []
    if answer.content or not answer.calls:
        blocks.append({"type": "text", "text": answer.content})
    blocks.extend(tool_use_block(tool_use_id(), name, arguments) for name, arguments in answer.calls)
    return blocks, bool(answer.calls)
