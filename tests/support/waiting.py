"""Polling for a condition, with a bound."""

from __future__ import annotations

import time
from collections.abc import Callable

POLL_S = 0.02


def wait_for(predicate: Callable[[], object], what: str, timeout: float) -> float:
    """Poll ``predicate()`` every 20 ms until it is true; returns the seconds that took.

    Raises AssertionError naming ``what`` once ``timeout`` seconds have passed with it false
    (at once, after one check, when ``timeout`` is not positive).
    """
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(POLL_S)
    return time.monotonic() - started
