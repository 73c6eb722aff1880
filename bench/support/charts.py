"""The serving benchmark's chart (``server.png``): each side's median with its min-max, one panel
per kind of measure. matplotlib (the ``bench`` extra) is imported only when a chart is drawn.
"""

from __future__ import annotations

import pathlib
from typing import Any

from bench.support.servers import SIDES
from bench.support.workload import CONCURRENCY


def chart(summary: dict[str, Any], path: pathlib.Path) -> None:
    """Draw ``summary`` (``report.serving_summary``'s) into the PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [
        ("Throughput (tok/s, higher is better)", [f"tps_{c}" for c in CONCURRENCY], [f"{c} str." for c in CONCURRENCY]),
        (
            "TTFT (ms)",
            ["ttft_p50_1", "ttft_p95_1", "ttft_p50_4", "ttft_p95_4", "ttft_busy_p50_4", "turn1_ttft", "turn2_ttft"],
            ["p50 @1", "p95 @1", "p50 @4", "p95 @4", "busy p50 @4", "turn 1", "turn 2"],
        ),
        ("Peak RSS (MiB)", ["rss"], [""]),
        ("After a disconnect (s)", ["disconnect_cpu", "disconnect_idle"], ["CPU", "to idle"]),
        ("SIGTERM, 2 streams (s)", ["sigterm_exit"], ["to exit"]),
        ("Startup (s)", ["startup", "first_answer"], ["to /health 200", "to 1st answer"]),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    colours = {"llama-server": "#4c72b0", "ours": "#dd8452"}
    for ax, (title, keys, labels) in zip(axes.flat, groups, strict=True):
        width = 0.38
        for j, side in enumerate(SIDES):
            xs, heights, lows, highs = [], [], [], []
            for i, key in enumerate(keys):
                s = summary[key][side]
                if s is None:
                    continue
                xs.append(i + (j - 0.5) * width)
                heights.append(s["median"])
                lows.append(s["median"] - s["min"])
                highs.append(s["max"] - s["median"])
            ax.bar(xs, heights, width, yerr=[lows, highs], capsize=3, label=side, color=colours[side])
        ax.set_xticks(range(len(keys)), labels)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend()
    fig.suptitle("llama-trio vs llama-server: median of runs, bars show min-max")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
