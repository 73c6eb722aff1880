"""What a test needs, as the markers pyproject.toml registers: ``model`` (the model, loaded in the
test's own process), ``server`` (a server process of ours), ``browser`` (Chromium), ``nginx``.
``make test-unit`` runs the tests that need none of them.

The markers are kept true by checks, not by care: the helpers that start a server process, a
browser or nginx call ``needs``, which fails a test that lacks the marker (``tests/conftest.py``
tells this module which test runs); and ``make test-unit`` hides the model (``--hide-model``),
so a test that loads it without the ``model`` marker fails there.
"""

from __future__ import annotations

from collections.abc import Iterable

# The markers of the test being run; None outside a pytest run (bench and scripts use the
# helpers too).
_markers: frozenset[str] | None = None


def running(markers: Iterable[str]) -> None:
    """The markers of the test that runs now (its setup, call and teardown)."""
    global _markers
    _markers = frozenset(markers)


def needs(marker: str, what: str) -> None:
    """Fails when the running test lacks ``marker``: it is about to start ``what``."""
    if _markers is not None and marker not in _markers:
        raise AssertionError(f"this test starts {what} but is not marked `{marker}` (@pytest.mark.{marker})")
