"""The compiled cffi module, process-wide llama.cpp set-up, and the C-to-Python callbacks.

``llama_backend_init`` runs once, on first import. llama.cpp's log lines go to the
``llama_trio.llama_cpp`` logger: its INFO output at DEBUG (quiet by default), warnings and errors as such.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

try:
    from ffi._llama import ffi, lib
except ImportError as exc:  # pragma: no cover - depends on the build state
    raise ImportError(
        "the llama.cpp binding is not built or not complete (ffi/_llama*.so and the libllama/libggml "
        "libraries beside it); in a checkout run `make setup` (or `python build_ffi.py`), else "
        f"reinstall llama-trio: {exc}"
    ) from exc

__all__ = ["ffi", "lib", "ProgressReporter", "log_lines"]

log = logging.getLogger("llama_trio.llama_cpp")

_LEVELS = {
    lib.GGML_LOG_LEVEL_DEBUG: logging.DEBUG,
    lib.GGML_LOG_LEVEL_INFO: logging.DEBUG,
    lib.GGML_LOG_LEVEL_WARN: logging.WARNING,
    lib.GGML_LOG_LEVEL_ERROR: logging.ERROR,
}

# Warnings llama.cpp writes for what we asked for, logged at DEBUG: a decode stopped by
# ``Context.interrupt`` drops the positions of the ubatch it was on.
_EXPECTED = ("decode: removing memory module entries",)
# And the errors it writes for that stop (its abort callback said stop), logged at DEBUG when
# the flag of the context this thread decodes with is set (``decoding``): a client that leaves
# mid-prefill is no error of ours. The same lines without the flag stay errors.
_INTERRUPTED = (
    "graph_compute: ggml_backend_sched_graph_compute_async failed",
    "process_ubatch: failed to compute graph",
    "llama_decode: failed to decode",
)


@contextlib.contextmanager
def restoring() -> Iterator[None]:
    """Within the block, this thread loads a saved sequence state: what llama.cpp logs about a
    state that does not fit (``n_stream mismatch``, no room) is logged at DEBUG, as the caller
    reports the failure to whoever asked (a client can send such a file as often as it likes)."""
    _threads.restoring = True
    try:
        yield
    finally:
        _threads.restoring = False


def decoding(flag: Any) -> None:
    """Say that this thread now decodes with the context whose interrupt flag is ``flag``."""
    _threads.flag = flag


def _interrupted() -> bool:
    flag = getattr(_threads, "flag", None)
    return flag is not None and bool(flag[0])


class _Lines:
    """llama.cpp writes a line in pieces (level CONT for the tail): joins them, so that each log
    record is one whole line. ``tap``: a list that also receives every line."""

    def __init__(self, tap: list[tuple[int, str]] | None = None) -> None:
        self.level = logging.DEBUG
        self.buf = ""
        self.tap = tap

    def feed(self, level: int, chunk: str, *, logged: bool = False) -> None:
        """``logged``: the piece reached the logger already (see ``log_lines``)."""
        if level != lib.GGML_LOG_LEVEL_CONT:
            self.level = _LEVELS.get(level, logging.DEBUG)
            self.buf = ""
        lines = (self.buf + chunk).split("\n")
        self.buf = lines.pop()
        for line in lines:
            if line.strip():
                if self.tap is not None:
                    self.tap.append((self.level, line.rstrip()))
                if not logged:
                    expected = (
                        line.startswith(_EXPECTED)
                        or (line.startswith(_INTERRUPTED) and _interrupted())
                        or getattr(_threads, "restoring", False)
                    )
                    level = logging.DEBUG if expected else self.level
                    log.log(level, "%s", line.rstrip())


_threads = threading.local()  # each thread's _Lines, and whether it captures


def _lines() -> _Lines:
    lines: _Lines | None = getattr(_threads, "lines", None)
    if lines is None:
        lines = _threads.lines = _Lines()
    return lines


@ffi.def_extern()
def _llama_trio_log(level: int, text: object, _user_data: object) -> None:
    _lines().feed(level, ffi.string(text).decode("utf-8", "replace"))


@contextlib.contextmanager
def log_lines() -> Iterator[list[tuple[int, str]]]:
    """Every line llama.cpp logs from this thread inside the block, at any level (debug lines
    too, whatever the logger lets through), as (logging level, text) in the list it yields,
    filled when the block ends. Meanwhile the lines are kept in C (``helpers.h``), so a long
    call logs without taking the GIL once per line; they reach the logger at the end, except
    warnings and errors, logged as they come. Does not nest (``Model`` and ``Context`` use it
    around their creation)."""
    if getattr(_threads, "capturing", False):
        raise RuntimeError("log_lines() does not nest")
    lines: list[tuple[int, str]] = []
    _threads.capturing = True
    lib.llama_trio_log_capture(1)
    try:
        yield lines
    finally:
        lib.llama_trio_log_capture(0)
        _threads.capturing = False
        out = ffi.new("const char **")
        size = lib.llama_trio_log_captured(out)
        records = ffi.unpack(out[0], size).split(b"\0")[:-1] if size else []
        lib.llama_trio_log_release()
        replay = _Lines(lines)
        for record in records:
            replay.feed((record[0] & 0x7F) - 1, record[1:].decode("utf-8", "replace"), logged=bool(record[0] & 0x80))


class ProgressReporter:
    """A model load's progress, kept in C (``struct llama_trio_progress``) while llama.cpp loads:
    ``progress`` reads it, ``abort()`` stops the load at its next report; each quarter reached is
    logged (Python hears of 5 reports, not one per tensor). Pass ``callback`` and ``state`` as
    llama.cpp's progress callback and its user data, and keep the reporter alive meanwhile."""

    callback: Any = ffi.addressof(lib, "llama_trio_progress_cb")

    def __init__(self, what: str, logger: logging.Logger) -> None:
        self.what = what
        self.logger = logger
        self._handle = ffi.new_handle(self)
        self.state: Any = ffi.new("struct llama_trio_progress *")
        self.state.quarter = -1
        self.state.report = lib._llama_trio_progress
        self.state.report_data = self._handle

    @property
    def progress(self) -> float:
        """The last fraction reported, 0 to 1."""
        return float(self.state.progress)

    @property
    def aborted(self) -> bool:
        return bool(self.state.aborted)

    def abort(self) -> None:
        self.state.aborted = 1

    def report(self, progress: float) -> None:
        self.logger.info("loading %s: %d%%", self.what, int(progress * 4) * 25)


@ffi.def_extern()
def _llama_trio_progress(progress: float, user_data: object) -> bool:
    reporter: ProgressReporter = ffi.from_handle(user_data)
    reporter.report(progress)
    return True


lib.llama_trio_log_install(lib._llama_trio_log)
lib.llama_backend_init()
