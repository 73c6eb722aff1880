"""llama-server's ``/slots``: what each sequence is doing (``GET``), and the actions on one
(``POST /slots/ID?action=save|restore|erase``).

The list gives counts only, never a sequence's tokens or text: with API keys, sequences hold
other tenants' prompts. For the same reason a caller saves, erases or restores into only a
sequence that holds its own scope's cache (or nothing), and what it restores is its own from
then on: its scope is its tenant's and the body's ``cache_salt``, as for its completions. Save and
restore keep files in the ``--slot-save-path`` folder only, each scope's in a subfolder of its
own (so one tenant's file names are not another's): a file name that is not a plain name (a
path, ``..``, a hidden file) is refused, links are not followed, and an entry that is not a
regular file (a directory, a FIFO) is neither read nor replaced (``slot_file``).
A busy sequence is a 409: the operation waits for no job; a failing folder (full, not
writable) a 503.
"""

from __future__ import annotations

import re
import time
from typing import Any

import trio
from quart import Response

from server.api import native_schema, slot_file
from server.api.errors import ApiError
from server.api.prepare import cache_scope
from server.api.respond import json_response
from server.engine import Engine, EngineError, Phase, SlotBusy, SlotOp
from server.models.registry import Lease
from server.state import ServerState

# A saved sequence's file name: letters, digits, dot, dash, underscore; not starting with a dot.
FILENAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}")
ACTIONS = ("save", "restore", "erase")


def slots_list(state: ServerState, lease: Lease, *, fail_on_no_slot: bool) -> Response:
    """Each sequence as llama-server lists its slots; with ``fail_on_no_slot``, a 503 when none
    is idle (a router's question: can this server take a request now?)."""
    if state.settings.no_slots:
        raise ApiError(501, "this server does not list its slots (started with --no-slots)", code="not_supported")
    engine = lease.engine
    views = engine.slot_ops.views()
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


async def slot_action(state: ServerState, lease: Lease, id_slot: str, action: str, body: dict[str, Any]) -> Response:
    """``POST /slots/ID?action=...``: checked (the folder is configured, the slot exists, the
    action is known, the file name stays in the folder), then done on the idle sequence.

    *Cancellation*: file work in a worker thread is waited for; the engine's part as
    ``SlotOpQueue.submit``.
    """
    folder = state.settings.slot_save_path
    if folder is None:
        message = "this server does not save or restore slots; start it with --slot-save-path"
        raise ApiError(501, message, code="not_supported")
    engine, info = lease.engine, lease.info
    seq_id = slot_number(id_slot)
    if seq_id is None or seq_id >= engine.config.n_parallel:
        raise ApiError(400, f"invalid slot id {id_slot[:16]!r}", param="id_slot", code="invalid_value")
    if action not in ACTIONS:
        raise ApiError(400, f"invalid action {action[:16]!r}; one of save, restore, erase", param="action")
    try:
        scope = cache_scope(native_schema.cache_salt(body))
    except native_schema.NativeError as exc:
        raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
    started = time.monotonic()
    if action == "erase":
        op = await _engine_op(engine, SlotOp("erase", seq_id, scope))
        return json_response({"id_slot": seq_id, "n_erased": len(op.tokens)})
    filename = body.get("filename")
    if not isinstance(filename, str) or not FILENAME.fullmatch(filename):
        message = "filename must be a plain file name (letters, digits, '.', '-', '_'; no path)"
        raise ApiError(400, message, param="filename", code="invalid_value")
    if action == "save":
        op = await _engine_op(engine, SlotOp("save", seq_id, scope))
        try:
            written = await trio.to_thread.run_sync(
                slot_file.write, folder, filename, info.fingerprint, scope, op.tokens, op.data
            )
        except slot_file.SlotFileError as exc:
            raise ApiError(409, f"{filename}: {exc}", param="filename", code="conflict") from None
        except slot_file.StorageError as exc:
            raise _storage(filename, exc) from None
        ms = (time.monotonic() - started) * 1000
        payload = {"id_slot": seq_id, "filename": filename, "n_saved": len(op.tokens), "n_written": written}
        return json_response({**payload, "timings": {"save_ms": ms}})
    try:
        tokens, data, size = await trio.to_thread.run_sync(slot_file.read, folder, filename, info.fingerprint, scope)
    except (FileNotFoundError, slot_file.NotOwner):  # another tenant's file is none of its business
        raise ApiError(404, f"no saved slot named {filename!r}", param="filename", code="not_found") from None
    except slot_file.SlotFileError as exc:
        raise ApiError(400, f"{filename}: {exc}", param="filename", code="invalid_value") from None
    except slot_file.StorageError as exc:
        raise _storage(filename, exc) from None
    if len(tokens) >= engine.n_ctx_seq or any(not 0 <= t < engine.vocab.n_tokens for t in tokens):
        raise ApiError(400, f"{filename} does not fit this server's sequences", param="filename", code="invalid_value")
    op = await _engine_op(engine, SlotOp("restore", seq_id, scope, tokens, data))
    ms = (time.monotonic() - started) * 1000
    payload = {"id_slot": seq_id, "filename": filename, "n_restored": len(tokens), "n_read": size}
    return json_response({**payload, "timings": {"restore_ms": ms}})


# More digits than any slot number has (int() refuses over 4300 digits): no such slot.
_MAX_SLOT_DIGITS = 9


def slot_number(id_slot: str) -> int | None:
    """The slot number a path names (ASCII digits, leading zeros allowed), or None."""
    if not id_slot.isascii() or not id_slot.isdigit():
        return None
    digits = id_slot.lstrip("0") or "0"
    return int(digits) if len(digits) <= _MAX_SLOT_DIGITS else None


def _storage(filename: str, exc: slot_file.StorageError) -> ApiError:
    """The slot folder failing (full, not writable): the server's trouble, said plainly."""
    return ApiError(503, f"{filename}: {exc}", type_="server_error", code="slot_storage_unavailable")


async def _engine_op(engine: Engine, op: SlotOp) -> SlotOp:
    try:
        return await engine.slot_ops.submit(op)
    except SlotBusy as exc:
        raise ApiError(409, str(exc), param="id_slot", code=exc.code) from None
    except EngineError as exc:
        raise ApiError.from_engine(exc) from None
