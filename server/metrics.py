"""Prometheus metrics, one registry per app (no module-level collectors)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from server.engine import EmbedderStats, EngineStats
from server.engine.compiler import CompileStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1)


class _EngineCollector(Collector):
    """Reads the engine's statistics at scrape time."""

    def __init__(
        self,
        stats: Callable[[], EngineStats | None],
        draining: Callable[[], bool],
        embedder: Callable[[], EmbedderStats | None],
    ) -> None:
        self._stats = stats
        self._draining = draining
        self._embedder = embedder

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily("llama_trio_draining", "1 while the server drains for shutdown", value=self._draining())
        embedder = self._embedder()
        if embedder is not None:
            yield GaugeMetricFamily(
                "llama_trio_embedding_requests",
                "embeddings requests in progress (embedding or waiting for their turn)",
                value=embedder.requests,
            )
            yield CounterMetricFamily("llama_trio_embedded_inputs", "inputs embedded", value=embedder.inputs)
            yield CounterMetricFamily(
                "llama_trio_embeddings_ended_early",
                "embeddings requests ended before all their inputs were embedded (the client gone, the drain)",
                value=embedder.ended_early,
            )
            yield CounterMetricFamily(
                "llama_trio_embeddings_interrupted_decodes",
                "embeddings decodes stopped part-way because their request ended",
                value=embedder.interrupted,
            )
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
            "llama_trio_chained_steps",
            "decode steps the decode thread went on to without waiting for the engine task",
            value=stats.chained_steps,
        )
        yield CounterMetricFamily(
            "llama_trio_interrupted_steps",
            "decode steps stopped part-way because no job in them was wanted any more",
            value=stats.interrupted_steps,
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


@dataclass
class RequestTotals:
    """What the completion requests add up to, from their own timing (``api/trace.py``)."""

    prompt_seconds: float = 0.0  # arrival to first token (queueing included)
    generation_seconds: float = 0.0  # first token to last
    longest_sequence: int = 0  # prompt + generated tokens, the most of any request


# llama-server's own metric names (its /metrics), for dashboards made for it: name, help, type.
_LLAMACPP = (
    ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", "counter"),
    ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", "counter"),
    ("prompt_seconds_total", "Total time spent processing prompts (queueing included)", "counter"),
    ("tokens_predicted_total", "Number of generation tokens processed", "counter"),
    ("tokens_predicted_seconds_total", "Total time spent generating tokens", "counter"),
    ("n_decode_total", "Total number of llama_decode() calls", "counter"),
    ("n_tokens_max", "Largest observed sequence length (prompt + generation)", "counter"),
    ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated (none here)", "counter"),
    ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted (none here)", "counter"),
    ("spec_decode_num_drafts_total", "Speculative: Total verification steps (none here)", "counter"),
    ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", "gauge"),
    ("predicted_tokens_seconds", "Average generation throughput in tokens/s", "gauge"),
    ("requests_processing", "Number of requests processing", "gauge"),
    ("requests_deferred", "Number of requests deferred", "gauge"),
    ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call", "gauge"),
)


def llamacpp_text(stats: EngineStats, totals: RequestTotals) -> str:
    """The engine's and the requests' figures under llama-server's ``llamacpp:`` names, in the
    text format it writes (the full name on every line)."""
    generated = stats.generated_tokens
    values = {
        "prompt_tokens_total": stats.prompt_tokens,
        "prompt_tokens_cached_total": stats.cached_tokens,
        "prompt_seconds_total": totals.prompt_seconds,
        "tokens_predicted_total": generated,
        "tokens_predicted_seconds_total": totals.generation_seconds,
        "n_decode_total": stats.decode_steps,
        "n_tokens_max": totals.longest_sequence,
        "prompt_tokens_seconds": stats.prompt_tokens / totals.prompt_seconds if totals.prompt_seconds else 0.0,
        "predicted_tokens_seconds": generated / totals.generation_seconds if totals.generation_seconds else 0.0,
        "requests_processing": stats.active,
        "requests_deferred": stats.queued,
        "n_busy_slots_per_decode": stats.busy_slot_steps / max(stats.decode_steps, 1),
    }
    lines = []
    for name, doc, kind in _LLAMACPP:
        lines += [f"# HELP llamacpp:{name} {doc}", f"# TYPE llamacpp:{name} {kind}"]
        lines.append(f"llamacpp:{name} {float(values.get(name, 0))!r}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class ModelRow:
    """One configured model's gauges: what a load balancer (the Gateway API Inference
    Extension's endpoint picker, for one) reads to pick a replica."""

    model: str
    loaded: bool
    waiting: int  # requests waiting for a sequence, or for the model to load
    running: int  # sequences prefilling or generating
    kv_usage: float  # KV cache cells in use, as a fraction of the context (0 to 1)


class _ModelCollector(Collector):
    """Reads each configured model's gauges at scrape time (labels: the configured ids)."""

    def __init__(self, rows: Callable[[], list[ModelRow]]) -> None:
        self._rows = rows

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {
            "loaded": GaugeMetricFamily("llama_trio_model_loaded", "1 while the model is loaded", labels=["model"]),
            "waiting": GaugeMetricFamily(
                "llama_trio_model_requests_waiting",
                "requests waiting for a sequence or for the model's load",
                labels=["model"],
            ),
            "running": GaugeMetricFamily(
                "llama_trio_model_requests_running", "sequences prefilling or generating", labels=["model"]
            ),
            "kv_usage": GaugeMetricFamily(
                "llama_trio_model_kv_cache_usage_ratio",
                "KV cache cells in use as a fraction of the model's context (0 to 1)",
                labels=["model"],
            ),
        }
        for row in self._rows():
            for name, family in families.items():
                family.add_metric([row.model], float(getattr(row, name)))
        yield from families.values()


class _GrammarCollector(Collector):
    """Reads the grammar compiler's statistics at scrape time (zeros before its first use)."""

    def __init__(self, stats: Callable[[], CompileStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._stats() or CompileStats()
        yield GaugeMetricFamily(
            "llama_trio_grammar_compiles_waiting", "grammar compiles queued for a thread", value=stats.waiting
        )
        yield GaugeMetricFamily(
            "llama_trio_grammar_compiles_running", "grammar compiles running (abandoned ones too)", value=stats.running
        )
        for name, doc, value in (
            ("compiles", "grammar compiles run", stats.compiles),
            ("compile_failures", "grammar compiles that refused the grammar", stats.failures),
            ("cache_hits", "grammars answered from the compiled-grammar cache (within a scope)", stats.cache_hits),
            ("compiles_refused", "grammar compiles refused because the queue was full", stats.overloaded),
            ("compiles_abandoned", "waits for a grammar compile that ended first", stats.abandoned),
            ("compile_seconds", "seconds spent compiling grammars", stats.seconds),
        ):
            yield CounterMetricFamily(f"llama_trio_grammar_{name}", doc, value=value)


class Metrics:
    def __init__(
        self,
        stats: Callable[[], EngineStats | None],
        draining: Callable[[], bool],
        models: Callable[[], list[ModelRow]] = list,
        grammars: Callable[[], CompileStats | None] = lambda: None,
        embedder: Callable[[], EmbedderStats | None] = lambda: None,
    ) -> None:
        self._stats = stats
        self.totals = RequestTotals()
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
        self.registry.register(_EngineCollector(stats, draining, embedder))
        self.registry.register(_ModelCollector(models))
        self.registry.register(_GrammarCollector(grammars))

    def render(self) -> bytes:
        """Ours, then llama-server's names (``llamacpp:``) once the engine runs."""
        stats = self._stats()
        ours = generate_latest(self.registry)
        return ours if stats is None else ours + llamacpp_text(stats, self.totals).encode()
