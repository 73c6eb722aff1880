"""What every route shares to answer: the app's ``ServerState`` (``current_state``) and a JSON
answer (``json_response``; ``large_json_response`` for one that may be large)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from quart import Response, current_app, g

from server.api.preflight import off_loop
from server.state import ServerState

STATE_KEY = "llama_trio"  # where create_app keeps the state in the app's extensions
# A float written as JSON, in ``off_loop``'s unit (characters of text to tokenize): about 1 us
# here, so that 256 vectors of 576 (0.2 s) are written in a worker thread.
FLOAT_CHARS = 2
# About how much JSON one ``json.dumps`` call writes in ``json_parts`` (a few milliseconds).
JSON_PART = 64 * 1024


def current_state() -> ServerState:
    """The state of the app serving the current request."""
    state: ServerState = current_app.extensions[STATE_KEY]
    return state


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(_json(payload), status=status, content_type="application/json")


async def large_json_response(work: int, make: Callable[[], Any]) -> Response:
    """``json_response`` of ``make()``'s payload, made and written in a worker thread when
    ``work`` is large, as ``off_loop`` counts it, and written in parts (``json_parts``): an
    answer of megabytes never holds the event loop.

    *Cancellation*: as ``off_loop``.
    """
    body = await off_loop(work, lambda: b"".join(part.encode() for part in json_parts(make())))
    return Response(body, status=200, content_type="application/json")


def _json(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False).encode()


def json_parts(value: Any) -> list[str]:
    """``json.dumps(value, ensure_ascii=False)`` in parts of about ``JSON_PART`` characters
    each, one ``json.dumps`` call each. Its C encoder holds the GIL for a whole call, so one
    call over a large answer (68 MB of token pieces: 2 s) held the event loop from a worker
    thread too; between calls the thread lets it go. A list's parts are slices as long as its
    first item says fit in a part; dicts and lists of large items are written item by item."""
    parts: list[str] = []
    _write(value, parts)
    return parts


def _write(value: Any, parts: list[str]) -> None:
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        parts.append("{")
        for i, (key, item) in enumerate(value.items()):
            parts.append(f"{', ' if i else ''}{json.dumps(key, ensure_ascii=False)}: ")
            _write(item, parts)
        parts.append("}")
    elif isinstance(value, list) and value:
        first = len(json.dumps(value[0], ensure_ascii=False))
        if first > JSON_PART:
            parts.append("[")
            for i, item in enumerate(value):
                parts.append(", " if i else "")
                _write(item, parts)
            parts.append("]")
            return
        step = JSON_PART // (first + 2) + 1
        parts.append("[")
        for start in range(0, len(value), step):
            text = json.dumps(value[start : start + step], ensure_ascii=False)[1:-1]
            parts.append(f", {text}" if start else text)
        parts.append("]")
    else:
        parts.append(json.dumps(value, ensure_ascii=False))


def tenant() -> str:
    """The current request's tenant: its API key's hash when keys are configured, else ""."""
    return str(g.get("tenant", ""))
