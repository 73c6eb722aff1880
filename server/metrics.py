"""Prometheus metrics, one registry per app (no module-level collectors)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from server.engine import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1)


class _EngineCollector(Collector):
    """Reads the engine's statistics at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats | None], draining: Callable[[], bool]) -> None:
        self._stats = stats
        self._draining = draining

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily("llama_trio_draining", "1 while the server drains for shutdown", value=self._draining())
        stats = self._stats()
        if stats is None:
            return
        for name, doc, value in (
            ("queue_depth", "requests waiting for a sequence", stats.queued),
            ("active_sequences", "sequences prefilling or generating", stats.active),
            ("paused_sequences", "sequences paused by a slow reader", stats.paused),
            ("kv_cells_used", "KV cache cells in use", stats.kv_cells_used),
            ("kv_cells_cached", "KV cells kept by idle sequences for prefix reuse", stats.kv_cells_cached),
            ("last_step_seconds", "duration of the last decode step", stats.last_step_seconds),
            ("prompt_cache_bytes", "bytes of saved prompt prefixes held in host RAM", stats.prompt_cache_bytes),
            ("prompt_cache_entries", "saved prompt prefixes held in host RAM", stats.prompt_cache_entries),
        ):
            yield GaugeMetricFamily(f"llama_trio_{name}", doc, value=value)
        tokens = CounterMetricFamily("llama_trio_tokens", "tokens processed", labels=["kind"])
        tokens.add_metric(["prompt"], stats.prompt_tokens)
        tokens.add_metric(["cached"], stats.cached_tokens)
        tokens.add_metric(["generated"], stats.generated_tokens)
        yield tokens
        yield CounterMetricFamily("llama_trio_decode_steps", "decode steps run", value=stats.decode_steps)
        yield CounterMetricFamily(
            "llama_trio_decode_seconds", "seconds spent inside llama_decode", value=stats.decode_seconds
        )
        yield CounterMetricFamily(
            "llama_trio_constrained_tokens", "tokens sampled under a grammar", value=stats.constrained_tokens
        )
        yield CounterMetricFamily(
            "llama_trio_forced_tokens",
            "tokens a grammar forced, decoded without sampling (fast-forward)",
            value=stats.forced_tokens,
        )
        yield CounterMetricFamily(
            "llama_trio_constraint_seconds",
            "seconds spent on grammar masks and grammar steps (decode thread)",
            value=stats.constraint_seconds,
        )
        lookups = CounterMetricFamily(
            "llama_trio_prompt_cache_lookups", "host prompt cache lookups, by result", labels=["result"]
        )
        lookups.add_metric(["hit"], stats.prompt_cache_hits)
        lookups.add_metric(["miss"], stats.prompt_cache_misses)
        yield lookups
        for name, doc, value in (
            ("tokens_restored", "prompt tokens restored from host RAM", stats.prompt_cache_tokens_restored),
            ("saves", "sequence caches saved to host RAM", stats.prompt_cache_saves),
            ("evictions", "saved prefixes dropped to stay within --cache-ram", stats.prompt_cache_evictions),
            ("save_seconds", "seconds spent saving caches (decode thread)", stats.prompt_cache_save_seconds),
            ("restore_seconds", "seconds spent restoring caches (decode thread)", stats.prompt_cache_restore_seconds),
        ):
            yield CounterMetricFamily(f"llama_trio_prompt_cache_{name}", doc, value=value)
        cancels = CounterMetricFamily("llama_trio_cancellations", "jobs released early, by phase", labels=["phase"])
        for phase, count in stats.cancellations.items():
            cancels.add_metric([phase], count)
        yield cancels


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats | None], draining: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "llama_trio_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "llama_trio_time_to_first_token_seconds",
            "time to first token",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.token_latency = Histogram(
            "llama_trio_time_per_output_token_seconds",
            "mean time between tokens of a request",
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(stats, draining))

    def render(self) -> bytes:
        return generate_latest(self.registry)
