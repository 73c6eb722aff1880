"""Our server vs llama-server with every layer on the GPU: completion tokens/s at several
concurrencies, TTFT and startup, sides alternating (ABBA), one fresh server per run.

Both servers: the same model and llama.cpp build, ``--parallel`` sequences of ``--per-seq``
cells (one KV stream each), n_batch = n_ubatch = 512, flash attention on auto. The requests are
``bench.server``'s: streamed chats at temperature 0, end-of-generation banned, 128 tokens each
(``--waves`` per stream) for throughput, 16 for TTFT (``--ttft-requests`` per stream).

    python -m bench.gpu.measure --model M.gguf --llama-server PATH [--ngl all] [--runs 3]

Writes ``bench/results/gpu.md`` and ``gpu.json`` (also into ``--out`` when given).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import trio

from bench import common
from bench.support.measures import measure_throughput, measure_ttft
from bench.support.servers import Launched
from bench.support.workload import Session
from tests.support.ports import free_port

SIDES = ("llama-server", "ours")
BATCH = 512


def commands(args: argparse.Namespace, port: int) -> dict[str, list[str]]:
    ctx = str(args.parallel * args.per_seq)
    return {
        "llama-server": [
            str(args.llama_server), "-m", str(args.model), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(args.parallel), "-c", ctx, "--no-kv-unified", "-t", str(args.threads),
            "-tb", str(args.threads), "-b", str(BATCH), "-ub", str(BATCH), "-ngl", args.ngl, "--no-webui",
        ],
        "ours": [
            sys.executable, "-m", "server", "--model", str(args.model), "--host", "127.0.0.1",
            "--port", str(port), "--parallel", str(args.parallel), "--ctx-size", ctx,
            "--threads", str(args.threads), "--batch-size", str(BATCH), "--n-gpu-layers", args.ngl,
        ],
    }  # fmt: skip


def banned_tokens(model: pathlib.Path) -> list[int]:
    import ffi

    with ffi.Model(model, vocab_only=True) as m:
        return sorted(m.vocab.eog_tokens)


async def measure_side(session: Session, args: argparse.Namespace) -> dict[str, Any]:
    await session.chat(8)  # warm-up: the first request pays for lazily built state on both
    throughput = [await measure_throughput(session, c, args.waves) for c in args.concurrency]
    ttft = [await measure_ttft(session, c, args.ttft_requests) for c in args.ttft_concurrency]
    return {"throughput": throughput, "ttft": ttft}


def run_side(side: str, args: argparse.Namespace, banned: list[int], logs: pathlib.Path) -> dict[str, Any]:
    port = free_port()
    log_path = logs / f"{side}-{port}.log"
    with open(log_path, "wb") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(commands(args, port)[side], stdout=log, stderr=subprocess.STDOUT)
        try:
            session = Session(Launched(side, port, proc, started), banned)

            async def go() -> dict[str, Any]:
                startup = await session.server.wait_ready()
                return {"startup_s": startup, **await measure_side(session, args)}

            result = trio.run(go)
            result["gpu_memory_mib"] = _gpu_memory_mib(proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    text = log_path.read_text(errors="replace")
    result["placement"] = [line.strip() for line in text.splitlines() if "layers offloaded" in line][:1]
    return result


def _gpu_memory_mib(pid: int) -> int | None:
    """GPU memory the process holds, as nvidia-smi sees it (None: no nvidia-smi or not listed)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for row in out.splitlines():
        fields = [f.strip() for f in row.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            return int(fields[1])
    return None


def summarise(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side in SIDES:
        mine = [r for r in runs if r["side"] == side]
        out[side] = {
            "startup_s": common.Summary.of([r["startup_s"] for r in mine]),
            "tps": {
                c: common.Summary.of([t["tps"] for r in mine for t in r["throughput"] if t["concurrency"] == c])
                for c in args.concurrency
            },
            "ttft_p50_s": {
                c: common.Summary.of([t["p50_s"] for r in mine for t in r["ttft"] if t["concurrency"] == c])
                for c in args.ttft_concurrency
            },
        }
    return out


def markdown(summary: dict[str, Any], args: argparse.Namespace, info: dict[str, Any]) -> str:
    rows = []
    ls, us = summary["llama-server"], summary["ours"]
    for c in args.concurrency:
        a, b = ls["tps"][c], us["tps"][c]
        rows.append([f"completion tok/s, {c} streams", a.format(), b.format(), f"{b.median / a.median:.2f}"])
    for c in args.ttft_concurrency:
        a, b = ls["ttft_p50_s"][c], us["ttft_p50_s"][c]
        rows.append([f"TTFT p50, {c} streams (ms)", _ms(a), _ms(b), f"{b.median / a.median:.2f}"])
    a, b = ls["startup_s"], us["startup_s"]
    rows.append(["startup to /health 200 (s)", a.format(2), b.format(2), f"{b.median / a.median:.2f}"])
    table = common.markdown_table(["measure", "llama-server", "ours", "ours / llama-server (medians)"], rows)
    lines = [
        f"# GPU: ours vs llama-server ({info['date']})",
        "",
        f"Machine: {info['gpu']}; {info['cpu']}. Model: {info['model_desc']}. llama.cpp "
        f"{info['llama_cpp']} built with {info['cmake_args']}; {info['build']}.",
        "",
        f"Median (min-max) of {args.runs} runs per side, alternating (ABBA), one fresh server per run; "
        f"{args.parallel} sequences x {args.per_seq} cells, "
        f"{'everything on the CPU' if args.ngl == '0' else 'every layer on the GPU'} (-ngl {args.ngl}), "
        f"{args.threads} threads, batch 512; streamed chat at temperature 0, 128 tokens per request "
        f"({args.waves} per stream) for tok/s, 16 for TTFT. Ratios above 1 are better for tok/s, below 1 for the rest.",
        "",
        table,
        "",
        "Where the layers went: GPU memory each server held (nvidia-smi), and our start-up log's line:",
        "",
        *[f"- {side}: {info['gpu_memory_mib'].get(side)} MiB on the GPU" for side in SIDES],
        f"- ours: {'; '.join(info['placement'].get('ours', [])) or 'not logged'}",
        "",
        "Commands (port per run):",
        "",
        *[f"- {side}: `{' '.join(cmd)}`" for side, cmd in info["commands"].items()],
    ]
    return "\n".join(lines) + "\n"


def _ms(s: common.Summary) -> str:
    return f"{s.median * 1000:.0f} ({s.low * 1000:.0f}-{s.high * 1000:.0f})"


def _gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip() or "no GPU seen by nvidia-smi"
    except (OSError, subprocess.TimeoutExpired):
        return "no nvidia-smi"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=pathlib.Path, required=True)
    parser.add_argument("--llama-server", type=pathlib.Path, required=True)
    parser.add_argument("--ngl", default="all", help="layers on the GPU, both servers (default all)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--parallel", type=int, default=64)
    parser.add_argument("--per-seq", type=int, default=512, help="KV cells per sequence")
    parser.add_argument("--concurrency", type=_ints, default=(1, 4, 16, 64))
    parser.add_argument("--ttft-concurrency", type=_ints, default=(1, 4, 16))
    parser.add_argument("--waves", type=int, default=2)
    parser.add_argument("--ttft-requests", type=int, default=4)
    parser.add_argument("--build-note", default="", help="how long the build took, for the note")
    parser.add_argument("--cmake-args", default="", help="the build's CMAKE_ARGS, for the note")
    parser.add_argument("--out", type=pathlib.Path, help="also copy the results here")
    args = parser.parse_args(argv)
    if max(args.concurrency) > args.parallel:
        parser.error("--parallel must be at least the largest concurrency")
    banned = banned_tokens(args.model)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        for i in range(args.runs):
            for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                run = {"side": side, "order": len(runs) + 1, **run_side(side, args, banned, pathlib.Path(tmp))}
                tps = " ".join(f"{t['tps']:.0f}" for t in run["throughput"])
                ttft = " ".join(f"{t['p50_s'] * 1000:.0f}" for t in run["ttft"])
                startup = run["startup_s"]
                print(f"run {i + 1}/{args.runs} {side:<12} tok/s {tps}  ttft ms {ttft}  startup {startup:.2f}s")
                runs.append(run)
    import ffi

    with ffi.Model(args.model, vocab_only=True) as m:
        desc = f"{m.name}, {args.model.stat().st_size / 2**30:.2f} GiB"
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "gpu": _gpu_name(),
        "cpu": common.cpu_model(),
        "model_desc": desc,
        "llama_cpp": common.llama_pin().get("version", "?"),
        "cmake_args": args.cmake_args or "the default flags",
        "build": args.build_note or "build time not given",
        "placement": {r["side"]: r["placement"] for r in reversed(runs)},
        "gpu_memory_mib": {r["side"]: r["gpu_memory_mib"] for r in reversed(runs)},
        "commands": commands(args, 0),
    }
    summary = summarise(runs, args)
    text = markdown(summary, args, info)
    print(text)
    common.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (common.RESULTS_DIR / "gpu.md").write_text(text, encoding="utf-8")
    raw = {"info": info, "runs": runs, "medians": _medians(summary)}
    (common.RESULTS_DIR / "gpu.json").write_text(json.dumps(raw, indent=1, default=str), encoding="utf-8")
    if args.out is not None:
        for name in ("gpu.md", "gpu.json"):
            shutil.copy(common.RESULTS_DIR / name, args.out / name)


def _medians(summary: dict[str, Any]) -> dict[str, Any]:
    def walk(x: Any) -> Any:
        if isinstance(x, common.Summary):
            return x.as_dict()
        if isinstance(x, dict):
            return {str(k): walk(v) for k, v in x.items()}
        return x

    return dict(walk(summary))


if __name__ == "__main__":
    main()
