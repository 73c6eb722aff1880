"""``Outbox``: the pieces one decode step produced, queued by the engine task after the step
and handed out while the next one decodes: each to its reader's sink when one is armed
(``Pieces.deliver_directly``), otherwise into its job's bounded channel. Only the engine task
uses it.
"""

from __future__ import annotations

import logging

import trio

from server.engine.choice import Choice
from server.engine.jobs import Piece

logger = logging.getLogger("llama_trio.engine")


class Outbox:
    """Pieces waiting for ``hand_out``, in order."""

    __slots__ = ("_queued",)

    def __init__(self) -> None:
        self._queued: list[tuple[Choice, Piece, bool]] = []

    def queue(self, choice: Choice, piece: Piece, *, last: bool = False) -> None:
        """Queue ``piece``; its room in the channel is held from now on (``Choice.sent``).
        ``last``: the choice's last piece, after which it counts as finished."""
        choice.sent += 1
        self._queued.append((choice, piece, last))

    def hand_out(self) -> None:
        """Hand out the queued pieces, each through its reader's sink or its channel."""
        queued, self._queued = self._queued, []
        for choice, piece, last in queued:
            choice.sent -= 1
            _hand_out_one(choice, piece)
            if last:
                choice.finish_choice()


def _hand_out_one(choice: Choice, item: Piece) -> None:
    sink = choice.sink
    if sink is not None:
        try:
            if sink(item):
                return
        except Exception:  # a reader's bug must never stop the engine task
            logger.exception("direct delivery failed; the job goes on through its channel")
        choice.sink = None
    try:
        choice.send.send_nowait(item)
        choice.sent += 1
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        choice.released = True  # the reader is gone
    except trio.WouldBlock:  # pragma: no cover - _plan never schedules a full channel
        logger.error("delivery to a full channel; dropping the job")
        choice.released = True
