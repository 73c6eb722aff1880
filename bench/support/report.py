"""Tables from runs. ``Metric`` says how to read one number out of a run; ``summarise_metrics``
gives each side's median (min-max) and the ratio of the medians, ``metric_rows`` the table rows
(both benchmarks over HTTP use them). Then the serving benchmark's own: its metrics, its summary
(with the SIGTERM outcomes and the json_schema costs) and its markdown.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from bench import common
from bench.support.servers import BATCH, SIDES
from bench.support.workload import (
    BUSY_TTFT_CONCURRENCY,
    CONCURRENCY,
    CTX,
    FAST_CONCURRENCY,
    FAST_MAX_TOKENS,
    FAST_SHAPE,
    JSON_CONCURRENCY,
    MAX_TOKENS,
    PARALLEL,
    TTFT_CONCURRENCY,
    TTFT_MAX_TOKENS,
)

# (key, label, unit, how to read a value out of a run, digits, higher is better)
Metric = tuple[str, str, str, Callable[[dict[str, Any]], float | None], int, bool]


def _reader(key: str, i: int, field: str, scale: float = 1) -> Callable[[dict[str, Any]], float]:
    """How a metric reads ``scale * run[key][i][field]`` out of a run."""

    def read(run: dict[str, Any]) -> float:
        return scale * run[key][i][field]

    return read


def _optional_reader(key: str, i: int, field: str) -> Callable[[dict[str, Any]], float | None]:
    """How a metric reads ``run[key][i][field]``, which may be None (not measured on that side)."""

    def read(run: dict[str, Any]) -> float | None:
        value = run[key][i][field]
        return None if value is None else float(value)

    return read


def _field_reader(key: str, field: str, scale: float = 1) -> Callable[[dict[str, Any]], float]:
    """How a metric reads ``scale * run[key][field]`` out of a run."""

    def read(run: dict[str, Any]) -> float:
        return scale * run[key][field]

    return read


def _serving_metrics() -> list[Metric]:
    """The serving benchmark's rows, in table order."""
    metrics: list[Metric] = []
    for i, c in enumerate(CONCURRENCY):
        metrics.append(
            (f"tps_{c}", f"completion tokens/s, {c} stream{'s' if c > 1 else ''}", "tok/s",
             _reader("throughput", i, "tps"), 1, True)
        )  # fmt: skip
    structured: list[tuple[str, str, str, str, int]] = [  # key, what, result, field, digits
        ("json_tps", "json_schema completion tokens/s", "json_throughput", "tps", 1),
        ("records_tps", "records json_schema completion tokens/s", "records_throughput", "tps", 1),
        ("tool_calls", "tool calls (required) per second", "tool_calls", "calls_per_s", 2),
    ]
    for key, what, result, field, digits in structured:
        unit = "calls/s" if field == "calls_per_s" else "tok/s"
        for i, c in enumerate(JSON_CONCURRENCY):
            label = f"{what}, {c} stream{'s' if c > 1 else ''}"
            metrics.append((f"{key}_{c}", label, unit, _optional_reader(result, i, field), digits, True))
    for i, c in enumerate(TTFT_CONCURRENCY):
        for q in ("p50", "p95"):
            metrics.append(
                (f"ttft_{q}_{c}", f"TTFT {q}, {c} stream{'s' if c > 1 else ''}", "ms",
                 _reader("ttft", i, f"{q}_s", 1000), 0, False)
            )  # fmt: skip
    busy = BUSY_TTFT_CONCURRENCY
    for q in ("p50", "p95"):
        metrics.append(
            (f"ttft_busy_{q}_{busy}", f"TTFT {q}, {busy} streams, one core kept busy by another process", "ms",
             _field_reader("ttft_busy", f"{q}_s", 1000), 0, False)
        )  # fmt: skip
    for i, c in enumerate(FAST_CONCURRENCY):
        metrics.append(
            (f"fast_tps_{c}", f"fast model: completion tokens/s, {c} stream{'s' if c > 1 else ''}", "tok/s",
             _reader("fast_throughput", i, "tps"), 1, True)
        )  # fmt: skip
    metrics += [
        ("turn1_ttft", "TTFT, first chat turn", "ms", lambda r: 1000 * r["second_turn"]["turn1_ttft_s"], 0, False),
        ("turn2_ttft", "TTFT, second turn (shared prefix)", "ms",
         lambda r: 1000 * r["second_turn"]["turn2_ttft_s"], 0, False),
        ("rss", "peak RSS (VmHWM)", "MiB", lambda r: r["peak_rss_bytes"] / 2**20, 0, False),
        ("disconnect_cpu", "CPU after a client disconnects", "s", lambda r: r["disconnect"]["cpu_s"], 2, False),
        ("disconnect_idle", "time until idle after the disconnect", "s",
         lambda r: r["disconnect"]["idle_after_s"], 2, False),
        ("sigterm_exit", "SIGTERM with 2 streams: seconds to exit", "s", lambda r: r["sigterm"]["exit_s"], 2, False),
        ("startup", "startup: launch to first 200 on /health", "s", lambda r: r["startup_s"], 2, False),
        ("first_answer", "startup: launch to the first answer (16 tokens)", "s",
         lambda r: r.get("first_answer_s"), 2, False),
    ]  # fmt: skip
    return metrics


def summarise_metrics(runs: list[dict[str, Any]], metrics: Sequence[Metric]) -> dict[str, Any]:
    """Per metric: each side's median (min-max) over ``runs`` and the ratio of the medians."""
    summary: dict[str, Any] = {}
    for key, label, unit, get, _digits, higher in metrics:
        entry: dict[str, Any] = {"label": label, "unit": unit, "higher_is_better": higher}
        for side in SIDES:
            values = [v for r in runs if r["side"] == side and (v := get(r)) is not None]
            entry[side] = common.Summary.of(values).as_dict() if values else None
        if entry["ours"] and entry["llama-server"] and entry["llama-server"]["median"]:
            entry["ratio"] = entry["ours"]["median"] / entry["llama-server"]["median"]
        summary[key] = entry
    return summary


def metric_rows(summary: dict[str, Any], metrics: Sequence[Metric]) -> list[list[str]]:
    """One table row per metric: label, each side's median (min-max), the ratio."""
    rows = []
    for key, label, unit, _get, digits, _higher in metrics:
        entry = summary[key]
        cells = [f"{label} ({unit})"]
        for side in SIDES:
            s = entry[side]
            cells.append(common.Summary(s["median"], s["min"], s["max"], s["n"]).format(digits) if s else "-")
        ratio = entry.get("ratio")
        cells.append(f"{ratio:.2f}" if ratio is not None else "-")
        rows.append(cells)
    return rows


def serving_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The serving benchmark's summary: every metric, ours constrained / ours free, our mask
    cost per constrained token, and per side what SIGTERM left (streams, binds, exit codes)."""
    summary = summarise_metrics(runs, _serving_metrics())
    ours_free = {c: summary[f"tps_{c}"]["ours"] for c in JSON_CONCURRENCY}
    for name, key in (("json_vs_free", "json_tps"), ("records_vs_free", "records_tps")):
        ours = {c: summary[f"{key}_{c}"]["ours"] for c in JSON_CONCURRENCY}
        summary[name] = {
            str(c): ours[c]["median"] / ours_free[c]["median"] for c in JSON_CONCURRENCY if ours[c] and ours_free[c]
        }
    summary["tool_calls_made"] = {
        side: f"{sum(t['tool_calls'] for r in runs if r['side'] == side for t in r['tool_calls'])}/"
        f"{sum(t['requests'] for r in runs if r['side'] == side for t in r['tool_calls'])}"
        for side in SIDES
    }
    costs = [r["constraint_us_per_token"] for r in runs if r.get("constraint_us_per_token") is not None]
    summary["constraint_us_per_token"] = common.Summary.of(costs).as_dict() if costs else None
    for side in SIDES:
        sig = [r["sigterm"] for r in runs if r["side"] == side]
        summary[f"sigterm_{side}"] = {
            "well_formed_streams": sum(s["well_formed"] for s in sig),
            "streams": sum(len(s["streams"]) for s in sig),
            "plain_bind_ok": sum(s["plain_bind"] == "ok" for s in sig),
            "plain_bind_results": [s["plain_bind"] for s in sig],
            "runs": len(sig),
            "exit_codes": [s["exit_code"] for s in sig],
            "stream_endings": sorted(
                {f"{st['finish_reason'] or st['error_code'] or 'cut'}" for s in sig for st in s["streams"]}
            ),
        }
    return summary


def serving_markdown(summary: dict[str, Any], runs: int, info: dict[str, Any]) -> str:
    """``server.md``: what was run, the table, the json_schema costs, the SIGTERM endings, the
    machine and the versions (``info``: config, machine, git, llama_cpp, llama_server_version,
    max_foreign_cores)."""
    rows = metric_rows(summary, _serving_metrics())
    for label, field_ in (
        ("SIGTERM: streams well formed (finish or error event, [DONE], body end)", "well_formed_streams"),
        ("SIGTERM: plain bind of the port right after exit succeeds", "plain_bind_ok"),
    ):
        cells = [label]
        for side in SIDES:
            s = summary[f"sigterm_{side}"]
            total = s["streams"] if field_ == "well_formed_streams" else s["runs"]
            cells.append(f"{s[field_]}/{total}")
        cells.append("")
        rows.append(cells)
    header = ["measure", "llama-server", "ours", "ours / llama-server (medians)"]
    m = info["machine"]
    dirty = " (with uncommitted changes to server/ or ffi/)" if info["git"]["dirty"] else ""
    endings = {side: ", ".join(summary[f"sigterm_{side}"]["stream_endings"]) for side in SIDES}
    binds = {side: ", ".join(summary[f"sigterm_{side}"]["plain_bind_results"]) for side in SIDES}
    lines = [
        f"Median (min-max) of {runs} runs per side, alternating (ABBA); one fresh server per run with "
        f"{PARALLEL} sequences, {CTX} KV cells ({CTX // PARALLEL} per sequence, not unified), "
        f"{info['config']['threads']} threads, batch {BATCH}; streamed chat, temperature 0, "
        f"{MAX_TOKENS} tokens per request for throughput ({info['config']['waves']} requests per stream), "
        f"{TTFT_MAX_TOKENS} for TTFT. The fast model: a random-weight llama ({FAST_SHAPE} in bench/random_model.py: "
        f"64 wide, 2 layers, the default model's tokenizer), {info['config']['fast_threads']} thread(s), "
        f"{FAST_MAX_TOKENS} tokens per request, a fresh server of each side after the other measurements. "
        "Ratios above 1 are better for tokens/s, below 1 for everything else.",
        "",
        common.markdown_table(header, rows),
        "",
        "json_schema streams (an array of at least 100 integers, so every stream runs to "
        f"{MAX_TOKENS} tokens): ours constrained / ours free, medians: "
        + ", ".join(f"{v:.2f} at {c}" for c, v in summary["json_vs_free"].items())
        + "; our mask cost per constrained token (mean of a run, median of runs): "
        + (f"{summary['constraint_us_per_token']['median']:.0f} us." if summary["constraint_us_per_token"] else "-."),
        "",
        "Records streams (an array of at least 40 objects with three declared keys, closed; the grammar forces "
        "the keys, quotes, colons and braces, which ours fast-forwards): ours constrained / ours free, medians: "
        + ", ".join(f"{v:.2f} at {c}" for c, v in summary["records_vs_free"].items())
        + ". Tool calls: a two-parameter tool, `tool_choice: required`, greedy, streamed; answers that were "
        "tool calls: "
        + "; ".join(f"{side}: {summary['tool_calls_made'][side]}" for side in SIDES)
        + " (a side with answers in text instead has no calls/s).",
        "",
        f"SIGTERM stream endings: llama-server: {endings['llama-server']}; ours: {endings['ours']}. "
        f"Plain bind after exit: llama-server: {binds['llama-server']}; ours: {binds['ours']}.",
        "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores ({m['cores_usable']} usable), {m['system']}, "
        f"Python {m['python']}. Other processes' load during the runs: at most "
        f"{info['max_foreign_cores']:.2f} cores (average over a run).",
        f"Versions: ours {info['git']['commit'][:12]}{dirty}; "
        f"llama.cpp {info['llama_cpp'].get('package', '')} {info['llama_cpp'].get('version', '')} "
        f"(both servers built from it; llama-server reports: {info['llama_server_version']}).",
    ]
    return "\n".join(lines)
