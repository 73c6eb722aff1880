"""What every route shares to answer: the app's ``ServerState`` (``current_state``) and a JSON
answer (``json_response``)."""

from __future__ import annotations

import json
from typing import Any

from quart import Response, current_app, g

from server.state import ServerState

STATE_KEY = "llama_trio"  # where create_app keeps the state in the app's extensions


def current_state() -> ServerState:
    """The state of the app serving the current request."""
    state: ServerState = current_app.extensions[STATE_KEY]
    return state


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(json.dumps(payload, ensure_ascii=False), status=status, content_type="application/json")


def tenant() -> str:
    """The current request's tenant: its API key's hash when keys are configured, else ""."""
    return str(g.get("tenant", ""))
