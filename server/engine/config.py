"""How an engine is shaped (``EngineConfig``) and what it and the embedder report
(``EngineStats``, ``EmbedderStats``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ffi
from server.engine.jobs import Phase


@dataclass(frozen=True)
class EngineConfig:
    n_parallel: int = 4
    n_ctx: int = 8192  # KV cells in all; each sequence has its own n_ctx // n_parallel
    n_batch: int = 512  # tokens per decode step, decoding tokens and prompt chunks together
    n_threads: int = 2
    max_queue: int = 64
    # Pieces buffered per job before its sequence pauses; a reader this far behind is slow.
    channel_size: int = 32
    # Host RAM for prompt prefixes evicted from the sequences (``prompt_cache``); 0: none.
    cache_bytes: int = 0
    # Flash attention, the KV cache's types and where it sits.
    attention: ffi.Attention = field(default_factory=ffi.Attention)
    # Tokens a grammar forces go into the next decode together (one step for the run), up to
    # n_batch // n_parallel per sequence; off: one step per token, each sampled under its mask.
    fast_forward: bool = True
    # The decode thread runs on to the next step by itself when the engine task would plan just
    # that (``chain``); off: the engine task plans every step (for comparisons).
    chain_steps: bool = True

    def context_options(self) -> dict[str, Any]:
        """``ffi.Context``'s options for the engine's context (a context handed to the engine
        must have been made with them). One KV stream per sequence: a sequence's cells sit at
        the same places whatever runs beside it, so greedy output does not depend on the other
        sequences (with a unified buffer, attention sums run in a layout-dependent order and
        can differ)."""
        return {
            "n_ctx": self.n_ctx,
            "n_batch": self.n_batch,
            "n_seq_max": self.n_parallel,
            "n_threads": self.n_threads,
            "kv_unified": False,
            "attention": self.attention,
        }


# While the engine is busy, the KV cell counts in ``EngineStats`` are refreshed every this many
# decode steps (two C calls per sequence each time); they are exact whenever the engine is idle.
KV_STATS_EVERY = 8


@dataclass
class EngineStats:
    """Counters and gauges the engine task keeps up to date; read them, never write them."""

    queued: int = 0
    active: int = 0
    paused: int = 0
    kv_cells_used: int = 0  # all cells in use, as llama.cpp reports them
    kv_cells_cached: int = 0  # of those, held by idle sequences for prefix reuse
    prompt_tokens: int = 0  # processed (not counting cached ones)
    cached_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0  # inside llama_decode, all steps together
    busy_slot_steps: int = 0  # sequences in each step, summed over the steps
    constrained_tokens: int = 0  # sampled under a grammar
    forced_tokens: int = 0  # forced by a grammar: appended without sampling (fast-forward)
    constraint_seconds: float = 0.0  # their masks and grammar steps, in the decode thread
    chained_steps: int = 0  # steps the decode thread ran on to by itself (``chain``)
    interrupted_steps: int = 0  # stopped part-way: no job in them was wanted any more
    last_step_seconds: float = 0.0
    requests_finished: int = 0
    # The host-memory prompt cache (``prompt_cache.HostCache``)
    prompt_cache_hits: int = 0  # jobs that restored a saved prefix
    prompt_cache_misses: int = 0  # jobs that looked and found nothing better than the sequences
    prompt_cache_tokens_restored: int = 0
    prompt_cache_saves: int = 0
    prompt_cache_evictions: int = 0  # saved prefixes dropped (least recently used) to stay in bounds
    prompt_cache_bytes: int = 0
    prompt_cache_entries: int = 0
    prompt_cache_save_seconds: float = 0.0
    prompt_cache_restore_seconds: float = 0.0
    cancellations: dict[str, int] = field(default_factory=lambda: {p.value: 0 for p in Phase})


@dataclass
class EmbedderStats:
    """What the embedder keeps up to date; read it, never write it."""

    requests: int = 0  # in progress: embedding, or waiting for their turn
    inputs: int = 0  # inputs embedded, all requests together
    ended_early: int = 0  # requests that ended before all their inputs were embedded
    interrupted: int = 0  # decodes stopped part-way because their request ended
