"""Operations on one idle sequence that a caller asks for by number (llama-server's slot save,
restore and erase): copy its state out, load a state into it, or drop its cells; and what the
sequences hold, for an operator (``views``, ``cell_counts``).

They are C work on the context, so they run as the prompt cache's copies do: the engine task
takes the queued operations between decode steps (``Engine._run_slot_ops``), checks each one's
sequence is idle and its cache the caller's own (a tenant scope never reads or wipes another's),
and runs the copies in the decode thread while it waits (``run``). Files are the caller's
business: here a state is bytes and the tokens it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import trio

import ffi
from server.engine.choice import Slot
from server.engine.decode_thread import DecodeThread
from server.engine.jobs import EngineError, Phase, SequenceView, ShuttingDown

SlotOpKind = Literal["save", "restore", "erase"]


class SlotBusy(EngineError):
    """The sequence runs a job (or its cache is another tenant's): the operation was not done."""

    code = "slot_busy"
    status = 409


class SlotStateRejected(EngineError):
    """llama.cpp did not take the state (another model or context shape, or damaged)."""

    code = "invalid_slot_state"
    status = 400


@dataclass(eq=False)
class SlotOp:
    """One operation on sequence ``seq_id`` for cache scope ``scope``. A restore gives
    ``tokens`` and ``data``; a save gets them back; an erase gets ``tokens`` (what it held)."""

    kind: SlotOpKind
    seq_id: int
    scope: str
    tokens: list[int] = field(default_factory=list)
    data: bytes | bytearray = b""
    error: EngineError | None = None
    done: trio.Event = field(default_factory=trio.Event)


class SlotOpQueue:
    """The slot operations callers asked for, until the engine task runs them; and the
    sequences' views (``Engine.slot_ops.views()``)."""

    def __init__(
        self,
        context: ffi.Context,
        slots: list[Slot],
        thread: DecodeThread,
        wake: Callable[[], None],
        accepting: Callable[[], bool],
    ) -> None:
        self._context = context
        self._slots = slots
        self._thread = thread
        self._wake = wake
        self._accepting = accepting
        self._queue: list[SlotOp] = []

    @property
    def pending(self) -> bool:
        return bool(self._queue)

    def views(self) -> list[SequenceView]:
        """What each sequence is doing now (counts only)."""
        return views(self._slots)

    async def submit(self, op: SlotOp) -> SlotOp:
        """Run ``op`` on its sequence between two decode steps, when that sequence is idle;
        raises the ``EngineError`` it failed with (``SlotBusy``: not idle, or another scope's
        cache; ``SlotStateRejected``; ``ShuttingDown``).

        *Cancellation*: a cancelled caller stops waiting; the operation may still run (its
        result is then dropped; a restore still fills the sequence, for the caller's scope).
        """
        if not 0 <= op.seq_id < len(self._slots):
            raise ValueError(f"no sequence {op.seq_id}")
        if not self._accepting():
            raise ShuttingDown("server is shutting down")
        self._queue.append(op)
        self._wake()
        await op.done.wait()
        if op.error is not None:
            raise op.error
        return op

    async def run_pending(self, *, meanwhile: Callable[[], None]) -> None:
        """In the engine task: refuse the queued operations whose sequence is not free for
        them, run the others in the decode thread (``meanwhile`` runs here as it works).

        *Cancellation*: a run in progress is waited for (``DecodeThread.run``); every queued
        operation is answered either way.
        """
        ops, self._queue = self._queue, []
        runnable = []
        for op in ops:
            op.error = refusal(op, self._slots[op.seq_id])
            if op.error is None:
                runnable.append(op)
        try:
            if runnable:
                await self._thread.run(run, self._context, self._slots, runnable, meanwhile=meanwhile)
        finally:
            for op in ops:
                op.done.set()

    def fail_all(self, error: EngineError) -> None:
        """End every queued operation with ``error`` (the engine stops)."""
        ops, self._queue = self._queue, []
        for op in ops:
            op.error = error
            op.done.set()


def views(slots: list[Slot]) -> list[SequenceView]:
    """What each sequence is doing (counts only)."""
    out = []
    for slot in slots:
        choice = slot.choice
        if choice is None:
            out.append(SequenceView(slot.seq_id, False, len(slot.cached)))
        else:
            phase: Phase | None = choice.phase
            out.append(SequenceView(slot.seq_id, True, len(slot.cached), len(choice.prompt), choice.n_generated, phase))
    return out


def cell_counts(context: ffi.Context, slots: Sequence[Slot]) -> tuple[int, int]:
    """KV cells in use by all sequences, and of those, held by idle ones (two C calls each)."""
    used = cached = 0
    for slot in slots:
        cells = context.seq_cells(slot.seq_id)
        used += cells
        if slot.choice is None:
            cached += cells
    return used, cached


def refusal(op: SlotOp, slot: Slot) -> EngineError | None:
    """Why ``op`` cannot run on ``slot`` now, or None. Pure; the engine task asks."""
    if slot.choice is not None:
        return SlotBusy(f"slot {slot.seq_id} is running a request; try again when it is idle")
    # A restore reads nothing of it, but would drop it: refused as an erase.
    if slot.cached and slot.scope != op.scope:
        return SlotBusy(f"slot {slot.seq_id} holds another client's cache")
    return None


def run(context: ffi.Context, slots: list[Slot], ops: list[SlotOp]) -> None:
    """Do ``ops`` (each already checked by ``refusal``). Blocking: call it in the decode
    thread while the engine task waits."""
    for op in ops:
        slot = slots[op.seq_id]
        if op.kind == "save":
            data = bytearray(context.seq_state_size(slot.seq_id))
            try:
                context.seq_save(slot.seq_id, data)
            except ffi.ContextError as exc:
                op.error = SlotStateRejected(f"could not copy slot {slot.seq_id}'s state: {exc}")
                continue
            op.tokens, op.data = list(slot.cached), data
        elif op.kind == "erase":
            context.seq_rm(slot.seq_id)
            op.tokens = list(slot.cached)
            slot.cached.clear()
        else:
            _restore(context, slot, op)


def _restore(context: ffi.Context, slot: Slot, op: SlotOp) -> None:
    context.seq_rm(slot.seq_id)
    slot.cached.clear()
    # The state must hold exactly the cells its tokens say, from position 0: else it is not
    # what was saved with them, and reusing it would give wrong answers.
    restored = context.seq_restore(op.data, slot.seq_id)
    if not restored or context.seq_pos_max(slot.seq_id) + 1 != len(op.tokens) or _starts_late(context, slot, op):
        context.seq_rm(slot.seq_id)
        op.error = SlotStateRejected("the saved state does not fit this model and context, or is damaged")
        return
    slot.cached.extend(op.tokens)
    slot.scope = op.scope


def _starts_late(context: ffi.Context, slot: Slot, op: SlotOp) -> bool:
    return bool(op.tokens) and context.seq_pos_min(slot.seq_id) != 0
