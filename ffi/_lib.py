"""The compiled cffi module, process-wide llama.cpp set-up, and the C-to-Python callbacks.

``llama_backend_init`` runs once, on first import. llama.cpp's log lines go to the
``llama_trio.llama_cpp`` logger: its INFO output at DEBUG (quiet by default), warnings and errors as such.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

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

# llama.cpp writes a line in pieces (level CONT for the tail); join them per thread so each log
# record is one whole line.
_pending = threading.local()


@ffi.def_extern()
def _llama_trio_log(level: int, text: object, _user_data: object) -> None:
    chunk = ffi.string(text).decode("utf-8", "replace")
    if level != lib.GGML_LOG_LEVEL_CONT:
        _pending.level = _LEVELS.get(level, logging.DEBUG)
        _pending.buf = ""
    buf = getattr(_pending, "buf", "") + chunk
    lines = buf.split("\n")
    _pending.buf = lines.pop()
    tap = getattr(_pending, "tap", None)
    level = getattr(_pending, "level", logging.DEBUG)
    for line in lines:
        if line.strip():
            if tap is not None:
                tap.append((level, line.rstrip()))
            log.log(level, "%s", line.rstrip())


@contextlib.contextmanager
def log_lines() -> Iterator[list[tuple[int, str]]]:
    """Every line llama.cpp logs from this thread inside the block, at any level (debug lines
    too, whatever the logger lets through), as (logging level, text) in the list it yields."""
    previous = getattr(_pending, "tap", None)
    lines: list[tuple[int, str]] = []
    _pending.tap = lines
    try:
        yield lines
    finally:
        _pending.tap = previous


class ProgressReporter:
    """Receives llama.cpp's load progress; logs every 25 %; ``abort()`` stops the load."""

    def __init__(self, what: str, logger: logging.Logger) -> None:
        self.what = what
        self.logger = logger
        self.aborted = False
        self.progress = 0.0  # the last fraction reported, 0 to 1
        self._last_decile = -1

    def abort(self) -> None:
        self.aborted = True

    def report(self, progress: float) -> bool:
        self.progress = progress
        decile = int(progress * 4)
        if decile != self._last_decile:
            self._last_decile = decile
            self.logger.info("loading %s: %d%%", self.what, decile * 25)
        return not self.aborted


@ffi.def_extern()
def _llama_trio_progress(progress: float, user_data: object) -> bool:
    reporter: ProgressReporter = ffi.from_handle(user_data)
    return reporter.report(progress)


lib.llama_log_set(lib._llama_trio_log, ffi.NULL)
lib.llama_backend_init()
