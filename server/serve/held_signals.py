"""Signals that arrive while the process starts, before the lifecycle listens for its own (the
start's imports take a second or two on a small machine): held, not left to their default
action (SIGHUP's ends the process without a word, which also fails the hot restart whose new
process it is), and handed to the lifecycle once it listens (``take``)."""

from __future__ import annotations

import signal
from types import FrameType

_held: list[int] = []


def hold(*signums: int) -> None:
    """From now on, ``signums`` are kept for ``take`` instead of acted on."""
    for signum in signums:
        signal.signal(signum, _keep)


def _keep(signum: int, _frame: FrameType | None) -> None:
    _held.append(signum)


def take() -> list[int]:
    """The signals held so far, in order (each once)."""
    held = list(_held)
    _held.clear()
    return held
