"""Serving over HTTP, side by side: our server (``python -m server``) vs llama.cpp's ``llama-server``.

Both servers run the same model from the same pinned llama.cpp build with the same shape:
``PARALLEL`` sequences (16), ``CTX`` KV cells in all (8192, so 512 per sequence, one KV stream
per sequence: llama-server gets ``--no-kv-unified``, ours never unifies), the same threads,
n_batch = n_ubatch = 512, flash attention on auto, everything on the CPU. llama-server also gets
``--no-webui``; its other defaults stay (prompt cache on, ``--cache-ram`` 8 GiB, ``--poll 50``).
One server process serves every concurrency level of a run (parallel 16 for 1, 4 and 16
streams), as a deployment would.

The load generator is this one process: trio, raw sockets, a small HTTP/1.1 reader (chunked or
Content-Length bodies) and an SSE splitter; one TCP connection per request, which the client
closes after the body's end (so TIME_WAIT sockets land on the client's ports, not the server's).
Every request is a streamed chat completion at temperature 0 with ``stream_options.
include_usage``; its system message starts with a request number, so no two prompts share more
than a few tokens and neither server answers from its prompt cache unless a test means it to.
End-of-generation tokens get a logit bias of -100, so every stream runs to ``max_tokens`` and
both servers generate the same number of tokens.

One run of a side starts a fresh server and measures, in this order:

- startup: seconds from launch to the first 200 on ``/health``, and to the end of the first
  answer (a chat completion of 16 tokens, sent as soon as ``/health`` answers);
- aggregate completion tokens/s at 1, 4 and 16 concurrent streams: that many clients, each
  sending ``--waves`` requests of ``MAX_TOKENS`` (128) one after another; completion tokens
  (from ``usage``) / wall time from the first request to the end of the last stream;
- TTFT (request sent to the first non-empty content delta, connect included) p50 and p95 at
  1 and 4 concurrent streams: clients start 0.1 s apart and each sends ``--ttft-requests``
  requests of 16 tokens;
- TTFT p50 and p95 at 4 streams with a busy neighbour: the same, while another process (a
  spinning Python) keeps one core busy, as a shared machine does;
- structured output at 1 and 4 streams: completion tokens/s of json_schema streams (an array
  of numbers: the grammar forces little; records with declared keys: it forces most of the
  text), and tool calls per second (a two-parameter tool, ``tool_choice: required``, greedy;
  each answer one call), the same schema and tool on both servers;
- TTFT of a second chat turn (with a system prompt of about 250 tokens): turn 1 (64 tokens),
  then turn 2 = turn 1's messages + the assistant's answer + a new user message; both servers
  can reuse turn 1's cached prefix;
- CPU seconds the server spends after a client disconnects mid-stream (a 384-token stream
  closed after 16 pieces): utime + stime from ``/proc/PID/stat``, sampled every 20 ms until it
  stops rising for 0.5 s, and the time until it stopped;
- peak RSS (``VmHWM``), read after all of the above;
- SIGTERM with 2 streams (384 tokens) in flight: seconds to exit, whether each stream was
  well formed (a ``finish_reason`` or an error event, then ``data: [DONE]``, then the end of the
  chunked body) and whether a plain ``bind`` of the port (no ``SO_REUSEADDR``) succeeds at once.

Then a second fresh server of the same side serves the fast model (``bench/random_model.py``'s
``tiny``: a random-weight llama, 64 wide, 2 layers, the default model's tokenizer, written once
per benchmark run), on ``--fast-threads`` threads (1): aggregate completion tokens/s at 1, 4
and 16 streams of ``FAST_MAX_TOKENS`` (256). With a decode step of a few milliseconds, what each
server does per token around ``llama_decode`` decides these rows.

Sides alternate for ``--runs`` runs each, the first side flipping every run (llama-server,
ours, ours, llama-server, ...). The
machine may be shared: before each throughput, TTFT and second-turn measurement the benchmark
waits until other processes keep at most ``--max-foreign`` cores busy, and repeats the
measurement (at most ``--retries`` times) when they were busier than that while it ran; their
average load is recorded with every measurement and for the whole run.

    python -m bench.serving [--runs 4] [--threads 2] [--waves 2] [--ttft-requests 8] [--fast-threads 1]

Writes ``bench/results/server.md``, ``server.png`` and ``server.json``. This module is the run
and its order; the parts are in ``bench/support/``: the load client (``client``), the two
servers and their processes (``servers``), the requests (``workload``), the measurements
(``measures``), the table (``report``) and the chart (``charts``).
"""

from __future__ import annotations

import argparse
import compileall
import pathlib
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import trio

from bench import common, random_model
from bench.support.charts import chart
from bench.support.measures import (
    constraint_counters,
    guarded,
    measure_disconnect,
    measure_second_turn,
    measure_sigterm,
    measure_throughput,
    measure_ttft,
    measure_ttft_busy,
)
from bench.support.report import serving_markdown, serving_summary
from bench.support.servers import (
    LLAMA_SERVER,
    SIDES,
    Shape,
    abba,
    end_of_generation_tokens,
    launch,
    llama_server_version,
    server_command,
    vm_hwm_bytes,
)
from bench.support.structured import RECORDS_FORMAT, measure_tool_calls
from bench.support.workload import (
    BUSY_TTFT_CONCURRENCY,
    CONCURRENCY,
    CTX,
    FAST_CONCURRENCY,
    FAST_MAX_TOKENS,
    FAST_SHAPE,
    FAST_THREADS,
    JSON_CONCURRENCY,
    JSON_FORMAT,
    MAX_TOKENS,
    PARALLEL,
    TTFT_CONCURRENCY,
    TTFT_MAX_TOKENS,
    Session,
)

MEASURES = "our HTTP server vs llama-server: throughput, TTFT, prefix reuse, memory, disconnects, SIGTERM, startup"
RESULTS = "server"  # bench/results/server.{md,png,json}


@dataclass(frozen=True)
class Config:
    """A run's options (recorded as ``config`` in the results)."""

    threads: int
    waves: int
    ttft_requests: int
    conversations: int
    max_foreign: float = 0.25
    retries: int = 2
    fast_threads: int = FAST_THREADS

    @property
    def shape(self) -> Shape:
        return Shape(PARALLEL, CTX, self.threads)

    @property
    def fast_shape(self) -> Shape:
        return Shape(PARALLEL, CTX, self.fast_threads)


async def measure_all(session: Session, cfg: Config, watch: common.CpuWatch) -> dict[str, Any]:
    """Everything, in the order of the module's docstring; the server has exited at the end."""

    def guard(what: str, measurement: Callable[[], Awaitable[dict[str, Any]]]) -> Awaitable[dict[str, Any]]:
        return guarded(session, what, measurement, max_foreign=cfg.max_foreign, retries=cfg.retries)

    out: dict[str, Any] = {"startup_s": await session.server.wait_ready()}
    await session.chat(TTFT_MAX_TOKENS)  # warm-up, sent as /health answers: the first answer
    out["first_answer_s"] = time.perf_counter() - session.server.started
    out["throughput"] = [
        await guard(f"throughput at {c}", partial(measure_throughput, session, c, cfg.waves)) for c in CONCURRENCY
    ]
    out["ttft"] = [
        await guard(f"TTFT at {c}", partial(measure_ttft, session, c, cfg.ttft_requests)) for c in TTFT_CONCURRENCY
    ]
    c = BUSY_TTFT_CONCURRENCY
    out["ttft_busy"] = await guard(
        f"TTFT at {c} with a busy neighbour", partial(measure_ttft_busy, session, c, cfg.ttft_requests)
    )
    ours = session.server.side == "ours"
    before = await constraint_counters(session.port) if ours else None
    out["json_throughput"] = [
        await guard(f"json_schema throughput at {c}", partial(measure_throughput, session, c, cfg.waves, JSON_FORMAT))
        for c in JSON_CONCURRENCY
    ]
    out["records_throughput"] = [
        await guard(f"records throughput at {c}", partial(measure_throughput, session, c, cfg.waves, RECORDS_FORMAT))
        for c in JSON_CONCURRENCY
    ]
    out["tool_calls"] = [
        await guard(f"tool calls at {c}", partial(measure_tool_calls, session, c, cfg.waves * 2))
        for c in JSON_CONCURRENCY
    ]
    if before is not None:
        after = await constraint_counters(session.port)
        tokens = after[0] - before[0]
        out["constraint_us_per_token"] = 1e6 * (after[1] - before[1]) / tokens if tokens else None
    out["second_turn"] = await guard("the second turn", partial(measure_second_turn, session, cfg.conversations))
    out["disconnect"] = await measure_disconnect(session)
    out["peak_rss_bytes"] = vm_hwm_bytes(session.proc.pid)
    out["foreign_cores"] = watch.foreign_cores()
    out["sigterm"] = await measure_sigterm(session)
    return out


@dataclass(frozen=True)
class Models:
    """The default model, the fast model (written for this run) and the end-of-generation tokens
    both have (the same tokenizer), which every request bans."""

    default: pathlib.Path
    fast: pathlib.Path
    banned: list[int]


async def measure_fast(session: Session, cfg: Config) -> list[dict[str, Any]]:
    """The fast model's throughput at each of ``FAST_CONCURRENCY``, after a warm-up."""
    await session.server.wait_ready()
    await session.chat(TTFT_MAX_TOKENS)  # warm-up
    return [
        await guarded(
            session,
            f"fast-model throughput at {c}",
            partial(measure_throughput, session, c, cfg.waves, max_tokens=FAST_MAX_TOKENS),
            max_foreign=cfg.max_foreign,
            retries=cfg.retries,
        )
        for c in FAST_CONCURRENCY
    ]


def run_side(side: str, exe: pathlib.Path, models: Models, cfg: Config, logdir: pathlib.Path) -> dict[str, Any]:
    """Launch one server, measure everything, stop it with SIGTERM; then one on the fast model."""
    load = common.load_average()
    with launch(side, exe, models.default, cfg.shape, logdir) as server:
        watch = common.CpuWatch([server.proc.pid])
        measured = trio.run(measure_all, Session(server, models.banned), cfg, watch)
    with launch(side, exe, models.fast, cfg.fast_shape, logdir) as fast:
        measured["fast_throughput"] = trio.run(measure_fast, Session(fast, models.banned), cfg)
    return {"side": side, "port": server.port, "load_average": load, **measured}


def run_all(
    runs_per_side: int, exe: pathlib.Path, model_path: pathlib.Path, cfg: Config, banned: list[int]
) -> list[dict[str, Any]]:
    """Write the fast model, then run both sides ``runs_per_side`` times, alternating (ABBA);
    one line per run as it ends."""
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        fast = pathlib.Path(tmp) / f"random-{FAST_SHAPE}.gguf"
        random_model.write_model(model_path, fast, random_model.SHAPES[FAST_SHAPE])
        models = Models(model_path, fast, banned)
        for i, side in abba(runs_per_side):
            run = run_side(side, exe, models, cfg, pathlib.Path(tmp))
            run["order"] = len(runs) + 1
            tps = " ".join(f"{t['tps']:.0f}" for t in run["throughput"])
            fast_tps = " ".join(f"{t['tps']:.0f}" for t in run["fast_throughput"])
            print(
                f"run {i + 1}/{runs_per_side} {side:<12} tok/s@{'/'.join(map(str, CONCURRENCY))} {tps}  "
                f"fast model {fast_tps}  startup {run['startup_s']:.2f}s  sigterm exit {run['sigterm']['exit_s']}  "
                f"(other load {run['foreign_cores'] or 0.0:.2f} cores)",
                flush=True,
            )
            runs.append(run)
    return runs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.parser(
        MEASURES,
        tool=LLAMA_SERVER,
        runs_default=4,
        runs_help="runs per side, alternating ABBA",
        retries_default=2,
        max_foreign_help="wait for, and measure again after, other processes using more cores than this",
    )
    parser.add_argument("--waves", type=int, default=2, help="throughput requests per stream (default 2)")
    parser.add_argument("--ttft-requests", type=int, default=8, help="TTFT requests per stream (default 8)")
    parser.add_argument("--conversations", type=int, default=3, help="two-turn chats per run (default 3)")
    parser.add_argument(
        "--fast-threads", type=int, default=FAST_THREADS, help=f"fast-model servers' threads (default {FAST_THREADS})"
    )
    args = parser.parse_args(argv)
    if min(args.runs, args.threads, args.waves, args.ttft_requests, args.conversations, args.fast_threads) < 1:
        parser.error(
            "--runs, --threads, --waves, --ttft-requests, --conversations and --fast-threads must be at least 1"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = Config(
        args.threads,
        args.waves,
        args.ttft_requests,
        args.conversations,
        args.max_foreign,
        args.retries,
        args.fast_threads,
    )
    model_path = common.model_path(args.model)
    exe = common.llama_tool(LLAMA_SERVER, build=not args.no_build)
    # Our modules' bytecode written ahead, as `make` does (where PYTHONDONTWRITEBYTECODE is set,
    # stale bytecode would otherwise be compiled again at each of our starts).
    for package in ("ffi", "server"):
        compileall.compile_dir(str(common.REPO_ROOT / package), quiet=1)
    version = llama_server_version(exe)
    banned = end_of_generation_tokens(model_path)
    machine = common.machine_info()
    runs = run_all(args.runs, exe, model_path, cfg, banned)

    summary = serving_summary(runs)
    info = {
        "config": asdict(cfg),
        "machine": machine,
        "git": common.git_version(),
        "llama_cpp": common.llama_pin(),
        "llama_server_version": version,
        "max_foreign_cores": max((r.get("foreign_cores") or 0.0) for r in runs),
    }
    table = serving_markdown(summary, args.runs, info)
    print()
    print(table)
    common.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (common.RESULTS_DIR / f"{RESULTS}.md").write_text(table + "\n", encoding="utf-8")
    chart(summary, common.RESULTS_DIR / f"{RESULTS}.png")
    path = common.write_results(
        RESULTS,
        {
            "benchmark": RESULTS,
            "measures": MEASURES,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **info,
            "load_average_after": common.load_average(),
            "model": str(model_path),
            "banned_tokens": banned,
            "shape": {"parallel": PARALLEL, "ctx": CTX, "batch": cfg.shape.batch, "max_tokens": MAX_TOKENS},
            "fast_model": {
                "shape": FAST_SHAPE,
                **asdict(random_model.SHAPES[FAST_SHAPE]),
                "threads": cfg.fast_threads,
                "max_tokens": FAST_MAX_TOKENS,
            },
            "commands": {side: server_command(side, exe, model_path, cfg.shape, 0) for side in SIDES},  # port: per run
            "runs": runs,
            "summary": summary,
        },
    )
    print(f"\nwrote {path.relative_to(common.REPO_ROOT)}, {RESULTS}.md and {RESULTS}.png")


if __name__ == "__main__":
    main()
