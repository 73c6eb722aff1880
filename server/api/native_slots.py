"""llama-server's ``/slots``: what each sequence is doing (``GET``), and the actions on one
(``POST /slots/ID?action=save|restore|erase``).

The list gives counts only, never a sequence's tokens or text: with API keys, sequences hold
other tenants' prompts. Save and restore keep files in the ``--slot-save-path`` folder only: a
file name that is not a plain name in that folder (a path, ``..``, a hidden file) is refused.
Moving a sequence's state in and out of files is not done yet: those actions, and erase, answer
501 once the request is checked.
"""

from __future__ import annotations

import re
from typing import Any

from quart import Response

from server.api.errors import ApiError
from server.api.preflight import ready
from server.api.respond import json_response
from server.engine import Phase
from server.state import ServerState

# A saved sequence's file name: letters, digits, dot, dash, underscore; not starting with a dot.
FILENAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}")
ACTIONS = ("save", "restore", "erase")


def slots_list(state: ServerState, *, fail_on_no_slot: bool) -> Response:
    """Each sequence as llama-server lists its slots; with ``fail_on_no_slot``, a 503 when none
    is idle (a router's question: can this server take a request now?)."""
    if state.settings.no_slots:
        raise ApiError(501, "this server does not list its slots (started with --no-slots)", code="not_supported")
    engine, _ = ready(state)
    views = engine.sequences()
    if fail_on_no_slot and all(view.busy for view in views):
        raise ApiError.unavailable("no slot available", code="no_slot_available")
    out = []
    for view in views:
        entry: dict[str, Any] = {
            "id": view.seq_id,
            "n_ctx": engine.n_ctx_seq,
            "speculative": False,
            "is_processing": view.busy,
            "n_cached_tokens": view.cached_tokens,
        }
        if view.busy:
            entry["n_prompt_tokens"] = view.prompt_tokens
            entry["next_token"] = [
                {
                    "has_next_token": view.phase is not None,
                    "n_decoded": view.generated_tokens,
                    "prompt_done": view.phase is Phase.GENERATE,
                }
            ]
        out.append(entry)
    return json_response(out)


async def slot_action(state: ServerState, id_slot: str, action: str, body: dict[str, Any]) -> Response:
    """``POST /slots/ID?action=...``, checked: the folder is configured, the slot exists, the
    action is known, the file name stays in the folder. Then 501: not done yet."""
    if state.settings.slot_save_path is None:
        message = "this server does not save or restore slots; start it with --slot-save-path"
        raise ApiError(501, message, code="not_supported")
    engine, _ = ready(state)
    if not id_slot.isascii() or not id_slot.isdigit() or int(id_slot) >= engine.config.n_parallel:
        raise ApiError(400, f"invalid slot id {id_slot[:16]!r}", param="id_slot", code="invalid_value")
    if action not in ACTIONS:
        raise ApiError(400, f"invalid action {action[:16]!r}; one of save, restore, erase", param="action")
    if action != "erase":
        filename = body.get("filename")
        if not isinstance(filename, str) or not FILENAME.fullmatch(filename):
            message = "filename must be a plain file name (letters, digits, '.', '-', '_'; no path)"
            raise ApiError(400, message, param="filename", code="invalid_value")
    raise ApiError(501, f"slot {action} is not supported by this server yet", code="not_supported")
