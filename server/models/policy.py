"""Which models to unload, as pure functions of what is loaded: ``make_room`` (before a load,
within ``--models-max`` and ``--models-max-mb``) and ``idle_expired`` (``--sleep-idle-seconds``).

A model that is busy (a request running or queued on it, or waiting for it) is never chosen:
streams in flight are never unloaded from under them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Resident:
    """A model that holds memory: loaded, or loading."""

    id: str
    busy: bool  # requests running, queued or waiting on it; or still loading
    last_used: float  # when a request last finished with it (or it finished loading)
    bytes: int  # what it costs (its file's size)


def make_room(
    resident: Sequence[Resident], incoming_bytes: int, max_models: int | None, max_bytes: int | None
) -> list[str] | None:
    """The models to unload, least recently used first, so that one more model of
    ``incoming_bytes`` fits within ``max_models`` and ``max_bytes`` (None: no bound); None when
    it cannot fit even then (busy models hold the room: wait and ask again)."""
    count = len(resident) + 1
    total = sum(r.bytes for r in resident) + incoming_bytes

    def fits() -> bool:
        return (max_models is None or count <= max_models) and (max_bytes is None or total <= max_bytes)

    victims: list[str] = []
    for r in sorted((r for r in resident if not r.busy), key=lambda r: (r.last_used, r.id)):
        if fits():
            break
        victims.append(r.id)
        count -= 1
        total -= r.bytes
    return victims if fits() else None


def idle_expired(resident: Sequence[Resident], now: float, sleep_after: float | None) -> list[str]:
    """The models idle (not busy) for ``sleep_after`` seconds or more (None: never)."""
    if sleep_after is None:
        return []
    return [r.id for r in resident if not r.busy and now - r.last_used >= sleep_after]
