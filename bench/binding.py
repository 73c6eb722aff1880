"""Single-sequence generation speed: a plain Python loop over our binding vs ``llama-batched-bench``.

What is measured, for each side, on the same model, threads, prompt length (pp) and generation
length (tg), one sequence:

- *ours*: the loop of ``tests/test_ffi.py``'s ``generate``: one ``Context.decode`` of the pp prompt
  tokens, then tg steps of greedy ``Sampler.sample`` + a one-token ``Batch`` + ``Context.decode``.
  Generation speed is tg / (wall time of those tg steps), so it includes Python, cffi and greedy
  sampling; the decode calls alone are timed too (``tg_decode_tps``).
- *batched-bench*: llama.cpp's own ``llama-batched-bench`` (``-npl 1``) built from the same pinned
  source, which decodes tg single tokens without sampling and reports ``S_TG`` = tg / T_TG.

Both sides warm up with one 16-token decode first and use the same context settings (n_ctx,
n_batch = n_ubatch, threads, flash attention auto, no unified KV). Runs alternate ours, theirs,
ours, theirs ... so drift in machine load hits both; each run of ours gets a fresh context.
Prompt processing speed (pp / decode time of the prompt) is recorded as well.

    python -m bench.binding [--runs 5] [--model PATH] [--threads 2] [--pp 64] [--tg 128]

Prints a markdown table and writes the raw numbers to ``bench/results/binding.json``.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import subprocess
import time
from dataclasses import asdict, dataclass
from typing import Any

import ffi
from bench import common

BATCHED_BENCH = "llama-batched-bench"
MEASURES = "single-sequence generation tokens/s: a plain loop over our binding vs llama-batched-bench"
# Text the prompt is cut from; its content does not change the speed, only its length does.
PROMPT_TEXT = (
    "The history of the printing press begins with movable type, ink that clings to metal, and "
    "a screw press borrowed from wine makers. Within fifty years presses were working in many cities."
)
# batched-bench warms up with one decode of this many tokens before timing; we do the same.
WARMUP_TOKENS = 16
# A batched-bench run takes seconds here; a hung one should fail the benchmark, not block it.
BATCHED_BENCH_TIMEOUT_S = 600


@dataclass(frozen=True)
class Config:
    threads: int
    pp: int
    tg: int
    n_ctx: int
    n_batch: int


@dataclass(frozen=True)
class Run:
    """One timed run of one side; times in seconds."""

    side: str
    order: int
    t_pp: float
    t_tg: float
    pp_tps: float
    tg_tps: float
    t_tg_decode: float | None = None  # ours only: the decode calls inside the tg loop
    tg_decode_tps: float | None = None
    load_average: tuple[float, float, float] | None = None


def prompt_tokens(model: ffi.Model, n: int) -> list[int]:
    """Exactly ``n`` tokens of real text (repeated when the text is shorter)."""
    tokens = model.vocab.tokenize(PROMPT_TEXT, add_special=False)
    return list(itertools.islice(itertools.cycle(tokens), n))


def run_ours(model: ffi.Model, cfg: Config, order: int) -> Run:
    """One run of the plain binding loop in a fresh context."""
    prompt = prompt_tokens(model, cfg.pp)
    greedy = ffi.SamplingParams(temperature=0)
    load = common.load_average()
    with (
        ffi.Context(
            model,
            n_ctx=cfg.n_ctx,
            n_batch=cfg.n_batch,
            n_ubatch=cfg.n_batch,
            n_seq_max=1,
            n_threads=cfg.threads,
            kv_unified=False,
        ) as context,
        ffi.Batch(max(cfg.pp, WARMUP_TOKENS)) as batch,
        ffi.Sampler(greedy, model.vocab.n_tokens) as sampler,
    ):
        batch.add_run(prompt[:WARMUP_TOKENS], 0, 0, logits_last=False)
        context.decode(batch)
        context.clear()

        batch.clear()
        index = batch.add_run(prompt, 0, 0, logits_last=True)
        # On the CPU backend decode returns when the logits are ready; sample() waits anyway.
        start = time.perf_counter()
        context.decode(batch)
        t_pp = time.perf_counter() - start

        pos = cfg.pp
        t_decode = 0.0
        start = time.perf_counter()
        for _ in range(cfg.tg):
            token = sampler.sample(context, index)
            batch.clear()
            index = batch.add(token, pos, 0, logits=True)
            pos += 1
            step = time.perf_counter()
            context.decode(batch)
            t_decode += time.perf_counter() - step
        t_tg = time.perf_counter() - start
    return Run(
        side="ours",
        order=order,
        t_pp=t_pp,
        t_tg=t_tg,
        pp_tps=cfg.pp / t_pp,
        tg_tps=cfg.tg / t_tg,
        t_tg_decode=t_decode,
        tg_decode_tps=cfg.tg / t_decode,
        load_average=load,
    )


def batched_bench_command(exe: pathlib.Path, model_path: pathlib.Path, cfg: Config) -> list[str]:
    return [
        str(exe),
        "-m", str(model_path),
        "-c", str(cfg.n_ctx),
        "-b", str(cfg.n_batch),
        "-ub", str(cfg.n_batch),
        "-npp", str(cfg.pp),
        "-ntg", str(cfg.tg),
        "-npl", "1",
        "-t", str(cfg.threads),
        "-ngl", "0",  # our Model loads on the CPU (n_gpu_layers=0); so does this, even in a GPU build
        "--output-format", "jsonl",
    ]  # fmt: skip


def parse_batched_bench(output: str, cfg: Config) -> dict[str, Any]:
    """The one JSONL record of a ``--output-format jsonl`` run for (pp, tg, pl=1)."""
    records: list[dict[str, Any]] = []
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            records.append(json.loads(line))
    matching = [r for r in records if (r["pp"], r["tg"], r["pl"]) == (cfg.pp, cfg.tg, 1)]
    if len(matching) != 1:
        raise RuntimeError(f"expected one batched-bench result for pp={cfg.pp} tg={cfg.tg} pl=1, got:\n{output}")
    return matching[0]


def run_batched_bench(
    exe: pathlib.Path, model_path: pathlib.Path, cfg: Config, order: int
) -> tuple[Run, dict[str, Any]]:
    load = common.load_average()
    proc = subprocess.run(
        batched_bench_command(exe, model_path, cfg),
        capture_output=True,
        text=True,
        timeout=BATCHED_BENCH_TIMEOUT_S,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{BATCHED_BENCH} exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    record = parse_batched_bench(proc.stdout + "\n" + proc.stderr, cfg)
    if record["n_threads"] != cfg.threads or record["n_threads_batch"] != cfg.threads:
        raise RuntimeError(f"{BATCHED_BENCH} ran with other thread counts than asked: {record}")
    run = Run(
        side="batched-bench",
        order=order,
        t_pp=record["t_pp"],
        t_tg=record["t_tg"],
        pp_tps=record["speed_pp"],
        tg_tps=record["speed_tg"],
        load_average=load,
    )
    return run, record


def report(runs: list[Run], cfg: Config) -> tuple[str, dict[str, Any]]:
    """The markdown table and the summary numbers behind it."""
    ours = [r for r in runs if r.side == "ours"]
    theirs = [r for r in runs if r.side == "batched-bench"]
    summary: dict[str, Any] = {}
    for side, rs in (("ours", ours), ("batched-bench", theirs)):
        summary[side] = {
            "tg_tps": common.Summary.of([r.tg_tps for r in rs]).as_dict(),
            "pp_tps": common.Summary.of([r.pp_tps for r in rs]).as_dict(),
        }
    ours_tg = common.Summary.of([r.tg_tps for r in ours])
    theirs_tg = common.Summary.of([r.tg_tps for r in theirs])
    decode_tg = common.Summary.of([r.tg_decode_tps for r in ours if r.tg_decode_tps is not None])
    pair_ratios = common.Summary.of([a.tg_tps / b.tg_tps for a, b in zip(ours, theirs, strict=False)])
    ratio = ours_tg.median / theirs_tg.median
    summary["ours"]["tg_decode_only_tps"] = decode_tg.as_dict()
    summary["tg_ratio_of_medians"] = ratio
    summary["tg_ratio_per_pair"] = pair_ratios.as_dict()

    rows = [
        [
            "ours (binding loop)",
            ours_tg.format(),
            common.Summary.of([r.pp_tps for r in ours]).format(),
        ],
        [
            "llama-batched-bench",
            theirs_tg.format(),
            common.Summary.of([r.pp_tps for r in theirs]).format(),
        ],
    ]
    header = [
        f"{cfg.threads} threads, pp {cfg.pp}, tg {cfg.tg}, npl 1",
        f"generation tok/s, median (min-max) of {len(ours)}",
        "prompt tok/s, median (min-max)",
    ]
    lines = [
        common.markdown_table(header, rows),
        "",
        f"ours / batched-bench, generation: {ratio:.3f} (ratio of medians); "
        f"per alternating pair {pair_ratios.format(3)}",
        f"ours, decode calls alone inside the generation loop: {decode_tg.format()} tok/s",
    ]
    return "\n".join(lines), summary


def main(argv: list[str] | None = None) -> None:
    parser = common.parser(MEASURES, tool=BATCHED_BENCH, runs_default=5, runs_help="runs of each side, alternating")
    parser.add_argument("--pp", type=int, default=64, help="prompt tokens")
    parser.add_argument("--tg", type=int, default=128, help="generated tokens")
    parser.add_argument("--ctx", type=int, default=2048, help="context size, both sides")
    parser.add_argument("--batch", type=int, default=512, help="n_batch = n_ubatch, both sides")
    args = parser.parse_args(argv)
    if min(args.runs, args.pp, args.tg, args.threads) < 1:
        parser.error("--runs, --pp, --tg and --threads must be at least 1")

    cfg = Config(threads=args.threads, pp=args.pp, tg=args.tg, n_ctx=args.ctx, n_batch=args.batch)
    model_path = common.model_path(args.model)
    exe = common.llama_tool(BATCHED_BENCH, build=not args.no_build)
    machine = common.machine_info()

    runs: list[Run] = []
    records: list[dict[str, Any]] = []
    with ffi.Model(model_path) as model:
        model_info = {
            "path": str(model_path),
            "name": model.name,
            "description": model.description,
            "size_bytes": model.size_bytes,
        }
        for i in range(args.runs):
            runs.append(run_ours(model, cfg, order=2 * i + 1))
            print(f"run {i + 1}/{args.runs}  ours          tg {runs[-1].tg_tps:7.1f} tok/s", flush=True)
            run, record = run_batched_bench(exe, model_path, cfg, order=2 * i + 2)
            runs.append(run)
            records.append(record)
            print(f"run {i + 1}/{args.runs}  batched-bench tg {run.tg_tps:7.1f} tok/s", flush=True)

    table, summary = report(runs, cfg)
    print()
    print(table)
    path = common.write_results(
        "binding",
        {
            "benchmark": "binding",
            "measures": MEASURES,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": asdict(cfg),
            "machine": machine,
            "load_average_after": common.load_average(),
            "model": model_info,
            "llama_cpp": common.llama_pin(),
            "batched_bench_command": batched_bench_command(exe, model_path, cfg),
            "batched_bench_records": records,
            "runs": [asdict(r) for r in runs],
            "summary": summary,
        },
    )
    print(f"\nraw numbers: {path.relative_to(common.REPO_ROOT)}")


if __name__ == "__main__":
    main()
