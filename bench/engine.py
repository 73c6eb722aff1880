"""Aggregate generation speed of the engine (no HTTP) vs ``llama-batched-bench``, by width.

What is measured, for each side, at each width W (number of sequences decoded together), on
the same model, threads, prompt length (pp) and generation length (tg):

- *ours*: ``server.engine`` with ``EngineConfig(n_parallel=W, n_ctx=W*ctx_per_seq, n_batch)``.
  W greedy jobs of pp distinct prompt tokens each are queued before the engine task runs, so
  they are admitted together and prefilled in one decode step (n_batch >= W*pp, as
  batched-bench's one prompt batch); each asks for tg + 1 tokens. The first token of every job
  comes from the prefill logits; the *generation window* runs from the moment every job has its
  first piece to the moment every job has finished. It holds exactly tg decode steps of W
  tokens (checked with ``engine.stats``), each followed by W samplings, detokenization and
  delivery: generation tokens/s = W * tg / window, the same count batched-bench's ``S_TG``
  divides by its ``T_TG``. End-of-generation tokens are banned with a logit bias of -inf, so no
  job ends early (greedy sampling otherwise unchanged).
- *batched-bench*: llama.cpp's own ``llama-batched-bench -npl W`` built from the same pinned
  source, with the same n_ctx, n_batch = n_ubatch, threads and sequence count (n_seq_max = W),
  KV per sequence (not unified) and flash attention on auto: one pp*W prompt batch, then tg
  decodes of W tokens without sampling. ``S_TG`` = W * tg / T_TG.

End-to-end speed is W * tg / (time from queueing the jobs to the last job's end) for ours and
W * tg / (T_PP + T_TG) for batched-bench: the same decode work (one prompt batch and tg
generation steps) on both sides; ours also samples and delivers the first token.

Both sides warm up with one 16-token decode first; each run of ours opens a fresh engine (and
context). Runs alternate in pairs at each width, and the side that goes first flips from pair
to pair (ours, theirs, theirs, ours, ...), so drift in machine load hits both, and neither
always runs first after the quiet wait. The machine may be shared: each pair waits until other processes keep at most
``--max-foreign`` cores busy; their CPU use during each run is recorded (``foreign_cores``), and
a pair during which they were busier is run again (at most ``--retries`` times; the discarded
runs are kept in the JSON).

    python -m bench.engine [--runs 5] [--widths 1,4,16] [--threads 2] [--pp 64] [--tg 128]

Prints a markdown table and writes the raw numbers to ``bench/results/engine.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import pathlib
import subprocess
import time
from dataclasses import asdict, dataclass
from typing import Any

import trio

import ffi
from bench import common
from bench.binding import BATCHED_BENCH, BATCHED_BENCH_TIMEOUT_S, PROMPT_TEXT, WARMUP_TOKENS
from server.engine import Engine, EngineConfig, Job, open_engine

MEASURES = "aggregate generation tokens/s of W concurrent greedy jobs: our engine vs llama-batched-bench"
# Widths the issue asks about: one stream, a few, and as many as a small server runs.
DEFAULT_WIDTHS = (1, 4, 16)
# The engine is expected to keep at least this share of llama.cpp's own batched speed.
TARGET_RATIO = 0.95
# Warm-up text; it shares no first token with the benchmark prompts, so no prefix is reused.
WARMUP_TEXT = "Warm-up: a few words that only exist to run the weights through the cache once."


@dataclass(frozen=True)
class Config:
    threads: int
    pp: int
    tg: int
    ctx_per_seq: int
    min_batch: int

    def n_ctx(self, width: int) -> int:
        return width * self.ctx_per_seq

    def n_batch(self, width: int) -> int:
        """All W prompts in one decode step on both sides."""
        return max(self.min_batch, width * self.pp)


@dataclass(frozen=True)
class Run:
    """One timed run of one side at one width; times in seconds."""

    side: str
    width: int
    order: int
    t_pp: float  # ours: queueing the jobs until every job has its first piece
    t_tg: float  # ours: the generation window (see the module docstring)
    tg_tps: float
    t_e2e: float
    e2e_tps: float
    pp_tps: float
    steps: int | None = None  # ours: decode steps inside the window (should be tg)
    # ours: the share of the window spent inside llama_decode (the rest is our per-step work:
    # sampling, hand-offs between threads, delivery); less noisy than the ratio, since both
    # parts see the same machine
    decode_share: float | None = None
    window_tokens: int | None = None  # ours: tokens generated inside the window (should be W*tg)
    load_average: tuple[float, float, float] | None = None
    foreign_cores: float | None = None  # other processes' average CPU use during the run


def prompt_tokens(model: ffi.Model, n: int, offset: int) -> list[int]:
    """``n`` tokens of real text starting ``offset`` tokens in (repeated when shorter)."""
    tokens = model.vocab.tokenize(PROMPT_TEXT, add_special=False)
    return list(itertools.islice(itertools.cycle(tokens), offset, offset + n))


def end_of_generation_tokens(vocab: ffi.Vocab) -> list[int]:
    return sorted(vocab.eog_tokens)


async def _timed_jobs(engine: Engine, jobs: list[Job]) -> dict[str, Any]:
    width = len(jobs)
    first: list[float | None] = [None] * width
    finish: list[str | None] = [None] * width
    mark: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as stack:
        start = time.perf_counter()
        # ``submit`` queues without a checkpoint: all jobs are queued before the engine task runs.
        streams = [await stack.enter_async_context(engine.submit(job)) for job in jobs]

        async def read(i: int) -> None:
            async for piece in streams[i]:
                if first[i] is None:
                    first[i] = time.perf_counter()
                    if all(t is not None for t in first):
                        mark["gen_start"] = first[i]
                        mark["tokens_at_start"] = engine.stats.generated_tokens
                        mark["steps_at_start"] = engine.stats.decode_steps
                        mark["decode_at_start"] = engine.stats.decode_seconds
                if piece.finish_reason:
                    finish[i] = piece.finish_reason

        async with trio.open_nursery() as nursery:
            for i in range(width):
                nursery.start_soon(read, i)
        end = time.perf_counter()
    if "gen_start" not in mark or any(f != "length" for f in finish):
        raise RuntimeError(f"jobs ended unexpectedly: {finish}")
    mark.update(
        start=start,
        end=end,
        window_tokens=engine.stats.generated_tokens - mark["tokens_at_start"],
        steps=engine.stats.decode_steps - mark["steps_at_start"],
        decode_s=engine.stats.decode_seconds - mark["decode_at_start"],
    )
    return mark


def run_ours(model: ffi.Model, cfg: Config, width: int, order: int, banned: list[int]) -> Run:
    """One run of W jobs through a fresh engine."""
    sampling = ffi.SamplingParams(temperature=0, logit_bias={t: float("-inf") for t in banned})
    prompts = [prompt_tokens(model, cfg.pp, offset=7 * j) for j in range(width)]
    warm = model.vocab.tokenize(WARMUP_TEXT, add_special=False)[:WARMUP_TOKENS]
    if any(p[0] == warm[0] for p in prompts):
        raise RuntimeError("the warm-up prompt shares a prefix with a benchmark prompt")
    config = EngineConfig(
        n_parallel=width,
        n_ctx=cfg.n_ctx(width),
        n_batch=cfg.n_batch(width),
        n_threads=cfg.threads,
        max_queue=max(64, width),
    )
    jobs = [Job(p, sampling, max_tokens=cfg.tg + 1) for p in prompts]
    load = common.load_average()
    watch = common.CpuWatch()

    async def main() -> dict[str, Any]:
        async with open_engine(model, config) as engine:
            async with engine.submit(Job(warm, sampling, max_tokens=1)) as pieces:
                async for _ in pieces:
                    pass
            return await _timed_jobs(engine, jobs)

    mark = trio.run(main)
    t_pp = mark["gen_start"] - mark["start"]
    t_tg = mark["end"] - mark["gen_start"]
    t_e2e = mark["end"] - mark["start"]
    if mark["steps"] != cfg.tg or mark["window_tokens"] != width * cfg.tg:
        raise RuntimeError(f"the generation window held {mark['steps']} steps and {mark['window_tokens']} tokens")
    return Run(
        side="ours",
        width=width,
        order=order,
        t_pp=t_pp,
        t_tg=t_tg,
        tg_tps=width * cfg.tg / t_tg,
        t_e2e=t_e2e,
        e2e_tps=width * cfg.tg / t_e2e,
        pp_tps=width * cfg.pp / t_pp,
        steps=mark["steps"],
        decode_share=mark["decode_s"] / t_tg,
        window_tokens=mark["window_tokens"],
        load_average=load,
        foreign_cores=watch.foreign_cores(),
    )


def batched_bench_command(exe: pathlib.Path, model_path: pathlib.Path, cfg: Config, width: int) -> list[str]:
    return [
        str(exe),
        "-m", str(model_path),
        "-c", str(cfg.n_ctx(width)),
        "-b", str(cfg.n_batch(width)),
        "-ub", str(cfg.n_batch(width)),
        "-npp", str(cfg.pp),
        "-ntg", str(cfg.tg),
        "-npl", str(width),
        "-t", str(cfg.threads),
        "-ngl", "0",  # our Model loads on the CPU (n_gpu_layers=0); so does this, even in a GPU build
        "--output-format", "jsonl",
    ]  # fmt: skip


def run_batched_bench(
    exe: pathlib.Path, model_path: pathlib.Path, cfg: Config, width: int, order: int
) -> tuple[Run, dict[str, Any]]:
    load = common.load_average()
    watch = common.CpuWatch()
    proc = subprocess.run(
        batched_bench_command(exe, model_path, cfg, width),
        capture_output=True,
        text=True,
        timeout=BATCHED_BENCH_TIMEOUT_S,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{BATCHED_BENCH} exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    records = [
        r
        for r in common.jsonl_records(proc.stdout + "\n" + proc.stderr, "speed_tg")
        if (r["pp"], r["tg"], r["pl"]) == (cfg.pp, cfg.tg, width)
    ]
    if len(records) != 1:
        raise RuntimeError(f"expected one {BATCHED_BENCH} result for pl={width}:\n{proc.stdout}{proc.stderr}")
    record = records[0]
    if record["n_threads"] != cfg.threads or record["n_threads_batch"] != cfg.threads:
        raise RuntimeError(f"{BATCHED_BENCH} ran with other thread counts than asked: {record}")
    t_e2e = record["t_pp"] + record["t_tg"]
    run = Run(
        side="batched-bench",
        width=width,
        order=order,
        t_pp=record["t_pp"],
        t_tg=record["t_tg"],
        tg_tps=record["speed_tg"],
        t_e2e=t_e2e,
        e2e_tps=width * cfg.tg / t_e2e,
        pp_tps=record["speed_pp"],
        load_average=load,
        foreign_cores=watch.foreign_cores(),
    )
    return run, record


def report(runs: list[Run], cfg: Config, widths: list[int]) -> tuple[str, dict[str, Any]]:
    """The markdown table and the summary numbers behind it."""
    summary: dict[str, Any] = {}
    rows = []
    for width in widths:
        ours = [r for r in runs if r.side == "ours" and r.width == width]
        theirs = [r for r in runs if r.side == "batched-bench" and r.width == width]
        entry: dict[str, Any] = {}
        for side, rs in (("ours", ours), ("batched-bench", theirs)):
            entry[side] = {
                key: common.Summary.of([getattr(r, key) for r in rs]).as_dict()
                for key in ("tg_tps", "e2e_tps", "pp_tps")
            }
        tg = (common.Summary.of([r.tg_tps for r in ours]), common.Summary.of([r.tg_tps for r in theirs]))
        e2e = (common.Summary.of([r.e2e_tps for r in ours]), common.Summary.of([r.e2e_tps for r in theirs]))
        pairs = common.Summary.of([a.tg_tps / b.tg_tps for a, b in zip(ours, theirs, strict=False)])
        e2e_pairs = common.Summary.of([a.e2e_tps / b.e2e_tps for a, b in zip(ours, theirs, strict=False)])
        ratio = tg[0].median / tg[1].median
        e2e_ratio = e2e[0].median / e2e[1].median
        share = common.Summary.of([r.decode_share for r in ours if r.decode_share is not None])
        entry.update(
            decode_share=share.as_dict(),
            tg_ratio_of_medians=ratio,
            tg_ratio_per_pair=pairs.as_dict(),
            e2e_ratio_of_medians=e2e_ratio,
            e2e_ratio_per_pair=e2e_pairs.as_dict(),
            meets_target=ratio >= TARGET_RATIO,
        )
        summary[str(width)] = entry
        rows.append(
            [
                str(width),
                tg[0].format(),
                tg[1].format(),
                f"{ratio:.3f}",
                f"{pairs.median:.3f} ({pairs.low:.3f}-{pairs.high:.3f})",
                f"{share.median * 100:.1f} %",
                e2e[0].format(),
                e2e[1].format(),
                f"{e2e_ratio:.3f}",
                "yes" if ratio >= TARGET_RATIO else "no",
            ]
        )
    n = len([r for r in runs if r.side == "ours" and r.width == widths[0]])
    header = [
        "width",
        "ours gen tok/s",
        "batched-bench gen tok/s",
        "gen ratio",
        "per-pair ratio",
        "ours in llama_decode",
        "ours e2e tok/s",
        "batched-bench e2e tok/s",
        "e2e ratio",
        f">= {TARGET_RATIO}",
    ]
    lines = [
        f"{cfg.threads} threads, pp {cfg.pp}, tg {cfg.tg}, {cfg.ctx_per_seq} KV cells per sequence; "
        f"median (min-max) of {n} alternating runs; gen ratio = ours / batched-bench (ratio of medians); "
        "per-pair ratio: median (min-max) of the ratios of runs side by side in time; ours in "
        "llama_decode: median share of our generation window spent inside llama_decode",
        "",
        common.markdown_table(header, rows),
    ]
    return "\n".join(lines), summary


def _widths(text: str) -> list[int]:
    widths = [int(part) for part in text.split(",") if part.strip()]
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError("widths are positive integers, comma-separated")
    return widths


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.parser(
        MEASURES,
        tool=BATCHED_BENCH,
        runs_default=5,
        runs_help="runs of each side per width, alternating",
        retries_default=4,
        retries_help="most repeats of one pair",
        max_foreign_help="run a pair again when other processes kept more cores than this busy",
    )
    parser.add_argument("--widths", type=_widths, default=list(DEFAULT_WIDTHS), help="e.g. 1,4,16")
    parser.add_argument("--pp", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--tg", type=int, default=128, help="generated tokens per sequence")
    parser.add_argument("--ctx-per-seq", type=int, default=256, help="KV cells per sequence, both sides")
    parser.add_argument("--batch", type=int, default=512, help="least n_batch = n_ubatch (raised to W*pp)")
    args = parser.parse_args(argv)
    if min(args.runs, args.pp, args.tg, args.threads) < 1:
        parser.error("--runs, --pp, --tg and --threads must be at least 1")
    if args.ctx_per_seq < args.pp + args.tg + 1:
        parser.error("--ctx-per-seq must hold pp + tg + 1 tokens")
    return args


def run_pairs(
    args: argparse.Namespace,
    cfg: Config,
    model: ffi.Model,
    model_path: pathlib.Path,
    exe: pathlib.Path,
    banned: list[int],
) -> tuple[list[Run], list[Run], list[dict[str, Any]]]:
    """Every width ``args.runs`` times, ours and batched-bench side by side; a pair that other
    processes disturbed is run again. Returns the runs kept, the runs discarded and
    batched-bench's records."""
    runs: list[Run] = []
    discarded: list[Run] = []
    records: list[dict[str, Any]] = []
    order = 0
    for i in range(args.runs):
        for width in args.widths:
            for attempt in range(args.retries + 1):
                common.wait_for_quiet(args.max_foreign)
                # ABBA: which side runs first (right after the quiet wait) flips every pair,
                # so neither always gets the idle machine or the warm one.
                if i % 2 == 0:
                    order += 1
                    mine = run_ours(model, cfg, width, order, banned)
                    order += 1
                    theirs, record = run_batched_bench(exe, model_path, cfg, width, order)
                else:
                    order += 1
                    theirs, record = run_batched_bench(exe, model_path, cfg, width, order)
                    order += 1
                    mine = run_ours(model, cfg, width, order, banned)
                busy = max(mine.foreign_cores or 0.0, theirs.foreign_cores or 0.0)
                print(
                    f"run {i + 1}/{args.runs} W={width:<3} ours {mine.tg_tps:6.1f}  batched-bench "
                    f"{theirs.tg_tps:6.1f} tok/s  (other load {busy:.2f} cores)",
                    flush=True,
                )
                if busy <= args.max_foreign or attempt == args.retries:
                    break
                discarded.extend([mine, theirs])
                print("  other processes were busy: this pair is run again", flush=True)
            runs.extend([mine, theirs])
            records.append(record)
    return runs, discarded, records


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = Config(args.threads, args.pp, args.tg, args.ctx_per_seq, args.batch)
    model_path = common.model_path(args.model)
    exe = common.llama_tool(BATCHED_BENCH, build=not args.no_build)
    machine = common.machine_info()
    with ffi.Model(model_path) as model:
        banned = end_of_generation_tokens(model.vocab)
        model_info = {"path": str(model_path), "name": model.name, "size_bytes": model.size_bytes}
        runs, discarded, records = run_pairs(args, cfg, model, model_path, exe, banned)

    table, summary = report(runs, cfg, args.widths)
    print()
    print(table)
    path = common.write_results(
        "engine",
        {
            "benchmark": "engine",
            "measures": MEASURES,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": asdict(cfg),
            "widths": args.widths,
            "banned_tokens": banned,
            "machine": machine,
            "load_average_after": common.load_average(),
            "model": model_info,
            "git": common.git_version(),
            "llama_cpp": common.llama_pin(),
            "batched_bench_commands": {w: batched_bench_command(exe, model_path, cfg, w) for w in args.widths},
            "batched_bench_records": records,
            "runs": [asdict(r) for r in runs],
            "discarded_runs": [asdict(r) for r in discarded],
            "summary": summary,
            "table": table,
        },
    )
    print(f"\nraw numbers: {path.relative_to(common.REPO_ROOT)}")


if __name__ == "__main__":
    main()
