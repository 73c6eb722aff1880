"""``Trace``: timing and outcome of one completion request, for its access-log line and the
request metrics (time to first token, time per output token)."""

from __future__ import annotations

import logging
import time
from typing import Any

from server.engine import Piece, Usage
from server.state import ServerState

logger = logging.getLogger("llama_trio.access")


def merged_usage(usages: list[Usage]) -> Usage:
    """The usage of a job from its choices' own (a prompt counts in its first choice only)."""
    return Usage(
        sum(u.prompt_tokens for u in usages),
        sum(u.completion_tokens for u in usages),
        sum(u.cached_tokens for u in usages),
        sum(u.restored_tokens for u in usages),
    )


def usage_payload(usage: Usage) -> dict[str, Any]:
    """``usage`` as OpenAI sends it."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class Trace:
    """One request's timing. ``piece`` is called with every piece delivered (directly or
    through the channel), ``log`` once at the end, whatever the end was."""

    def __init__(self, state: ServerState, path: str) -> None:
        self.state = state
        self.path = path
        self.start = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self._usages: list[Usage] = []  # each finished choice's
        self._longest = 0  # the completion tokens of its longest choice
        self.ending = "cancelled"
        self.status = 200
        self.written = 0.0  # trio time of the last write to a stream's body

    def piece(self, piece: Piece) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.state.metrics.ttft.observe(now - self.start)
        self.last = now
        if piece.finish_reason:
            if piece.usage is not None:
                self._usages.append(piece.usage)
                self._longest = max(self._longest, piece.usage.completion_tokens)
            self.ending = piece.finish_reason

    @property
    def usage(self) -> Usage | None:
        """The job's usage so far: its finished choices' together (n > 1, several prompts)."""
        return merged_usage(self._usages) if self._usages else None

    def log(self) -> None:
        usage = self.usage
        ttft = f"{(self.first - self.start) * 1000:.0f}ms" if self.first else "-"
        rate = "-"
        totals = self.state.metrics.totals
        if self.first is not None and self.last is not None:
            totals.prompt_seconds += self.first - self.start
            totals.generation_seconds += self.last - self.first
        if usage is not None:
            totals.longest_sequence = max(totals.longest_sequence, usage.total_tokens)
        # The choices of a job decode side by side: a token's latency is its longest choice's.
        if usage and self.first and self.last and self._longest > 1 and self.last > self.first:
            per_token = (self.last - self.first) / (self._longest - 1)
            self.state.metrics.token_latency.observe(per_token)
            rate = f"{1 / per_token:.1f}"
        logger.info(
            "POST %s %d prompt=%s completion=%s cached=%s restored=%s ttft=%s tok/s=%s end=%s total=%.0fms",
            self.path,
            self.status,
            usage.prompt_tokens if usage else "-",
            usage.completion_tokens if usage else "-",
            usage.cached_tokens if usage else "-",
            usage.restored_tokens if usage else "-",
            ttft,
            rate,
            self.ending,
            (time.monotonic() - self.start) * 1000,
        )
