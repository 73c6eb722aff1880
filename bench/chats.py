"""Many chats on few sequences: our prompt cache vs llama-server's, over HTTP.

Both servers run the same model from the same llama.cpp build with ``PARALLEL`` (4) sequences,
``CTX`` (8192) KV cells in all (2048 per sequence, one KV stream each), the same threads and
batch; llama-server keeps its defaults otherwise (prompt cache on, ``--cache-ram`` 8 GiB), ours
too (``--cache-ram`` 2 GiB). Requests go one at a time, streamed, temperature 0, end-of-generation
tokens banned so every answer has ``MAX_TOKENS`` tokens. One fresh server per run measures:

- **alternating prompts**: two different prompts (each with its own document of about 200
  tokens, sharing only the chat template's first tokens) sent alternately, ``ALTERNATIONS``
  times each, on a fresh server (three sequences idle and empty): TTFT median of the repeats.
  A server that puts the second prompt on the first one's sequence recomputes both every time;
- **many chats**: ``CONVERSATIONS`` (12) conversations, each with its own document of about
  850 tokens in the system message, ``TURNS`` (3) turns each, the turns arriving round-robin
  (every conversation's turn 1, then every turn 2, ...). With 12 conversations on 4 sequences,
  a later turn finds its history only in a cache beyond the sequences. Reported: TTFT p50 of
  the later turns (2 and 3) and of the first turns, and the median ``cached_tokens`` of the
  later turns.

Sides alternate (ABBA) for ``--runs`` runs each; before each scenario the benchmark waits until
other processes keep at most ``--max-foreign`` cores busy.

    python -m bench.chats [--runs 3] [--threads 2]

Writes ``bench/results/chats.md`` and ``chats.json``.
"""

from __future__ import annotations

import pathlib
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import trio

from bench import common
from bench.support.client import StreamResult
from bench.support.measures import wait_quiet
from bench.support.report import Metric, metric_rows, summarise_metrics
from bench.support.servers import LLAMA_SERVER, Shape, abba, end_of_generation_tokens, launch
from bench.support.workload import Session

MEASURES = "many chats on few sequences: host prompt cache and slot choice, ours vs llama-server"
PARALLEL = 4
CTX = 8192
CONVERSATIONS = 12
TURNS = 3
DOC_WORDS = 260  # about 850 tokens of this model
ALT_DOC_WORDS = 60  # about 200
ALTERNATIONS = 6
MAX_TOKENS = 16

_WORDS = (
    "amber basalt cobalt dune ember fjord granite harbor indigo juniper kelp lagoon marble nectar "
    "onyx prairie quartz river sierra tundra umber valley willow xenon yarrow zephyr"
).split()


def document(seed: int, words: int) -> str:
    """Text unlike any other seed's from its first word (no shared prefix beyond the template)."""
    return " ".join(f"{_WORDS[(seed * 7 + j * 11) % len(_WORDS)]}{(seed * 37 + j * 3) % 101}" for j in range(words))


async def ask(session: Session, messages: list[dict[str, str]]) -> StreamResult:
    result = await session.send(messages, MAX_TOKENS)
    if result.failure or result.status != 200 or result.completion_tokens != MAX_TOKENS or not result.well_formed:
        raise RuntimeError(f"a chat request failed: status={result.status} failure={result.failure} {result.error}")
    return result


def cached_tokens(result: StreamResult) -> int:
    return int(((result.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def measure_alternating(session: Session) -> dict[str, Any]:
    prompts = [
        [
            {"role": "system", "content": f"Reference {seed}: {document(100 + seed, ALT_DOC_WORDS)}"},
            {"role": "user", "content": "Which word comes first?"},
        ]
        for seed in range(2)
    ]
    repeats: list[float] = []
    for i in range(2 * ALTERNATIONS):
        result = await ask(session, prompts[i % 2])
        if i >= 2 and result.ttft is not None:
            repeats.append(result.ttft)
    return {"repeat_ttft_s": repeats, "p50_s": statistics.median(repeats)}


async def measure_many_chats(session: Session) -> dict[str, Any]:
    conversations = [
        [{"role": "system", "content": f"Document {i}: {document(i, DOC_WORDS)}. Answer briefly."}]
        for i in range(CONVERSATIONS)
    ]
    turns: list[dict[str, Any]] = []
    for turn in range(TURNS):
        for i, messages in enumerate(conversations):
            messages.append({"role": "user", "content": f"Question {turn + 1}: what is word {turn * 5 + 2}?"})
            result = await ask(session, messages)
            messages.append({"role": "assistant", "content": result.text})
            usage = result.usage or {}
            turns.append(
                {
                    "conversation": i,
                    "turn": turn + 1,
                    "ttft_s": result.ttft,
                    "prompt_tokens": usage.get("prompt_tokens"),
                    "cached_tokens": cached_tokens(result),
                }
            )
    later = [t for t in turns if t["turn"] > 1]
    first = [t for t in turns if t["turn"] == 1]
    return {
        "turns": turns,
        "first_ttft_p50_s": statistics.median(t["ttft_s"] for t in first),
        "later_ttft_p50_s": statistics.median(t["ttft_s"] for t in later),
        "later_cached_tokens_p50": statistics.median(t["cached_tokens"] for t in later),
        "later_prompt_tokens_p50": statistics.median(t["prompt_tokens"] or 0 for t in later),
    }


async def measure_all(session: Session, max_foreign: float) -> dict[str, Any]:
    """Startup, then each scenario once the machine is quiet."""
    out: dict[str, Any] = {"startup_s": await session.server.wait_ready()}
    out["alternating_waited_s"] = await wait_quiet(session, max_foreign)
    out["alternating"] = await measure_alternating(session)
    out["many_chats_waited_s"] = await wait_quiet(session, max_foreign)
    out["many_chats"] = await measure_many_chats(session)
    return out


def run_side(
    side: str,
    exe: pathlib.Path,
    model_path: pathlib.Path,
    shape: Shape,
    max_foreign: float,
    banned: Sequence[int],
    logdir: pathlib.Path,
) -> dict[str, Any]:
    """Launch one server, measure both scenarios, stop it."""
    with launch(side, exe, model_path, shape, logdir) as server:
        return {"side": side, **trio.run(measure_all, Session(server, banned), max_foreign)}


ROWS: tuple[Metric, ...] = (
    ("later_ttft", "many chats: TTFT p50, later turns", "ms",
     lambda r: 1000 * r["many_chats"]["later_ttft_p50_s"], 0, False),
    ("first_ttft", "many chats: TTFT p50, first turns", "ms",
     lambda r: 1000 * r["many_chats"]["first_ttft_p50_s"], 0, False),
    ("later_cached", "many chats: cached tokens p50, later turns", "tokens",
     lambda r: r["many_chats"]["later_cached_tokens_p50"], 0, True),
    ("alternating", "alternating prompts: TTFT p50 of repeats", "ms",
     lambda r: 1000 * r["alternating"]["p50_s"], 0, False),
)  # fmt: skip


def markdown(summary: dict[str, Any], runs: int, info: dict[str, Any]) -> str:
    rows = metric_rows(summary, ROWS)
    dirty = " (with uncommitted changes)" if info["git"]["dirty"] else ""
    return "\n".join(
        [
            f"Median (min-max) of {runs} runs per side, alternating (ABBA); one fresh server per run with "
            f"{PARALLEL} sequences, {CTX} KV cells, {info['threads']} threads; one request at a time, "
            f"{MAX_TOKENS} tokens each. Many chats: {CONVERSATIONS} conversations with their own document "
            f"(about 850 tokens), {TURNS} turns, round-robin. Alternating: two prompts with their own "
            f"document (about 200 tokens), {ALTERNATIONS} times each.",
            "",
            common.markdown_table(["measure", "llama-server", "ours", "ours / llama-server (medians)"], rows),
            "",
            f"Versions: ours {info['git']['commit'][:12]}{dirty}; llama.cpp {info['llama_cpp'].get('version', '')}.",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = common.parser(
        MEASURES,
        tool=LLAMA_SERVER,
        runs_default=3,
        runs_help="runs per side, alternating ABBA",
        max_foreign_help="wait for other processes using more cores than this",
    )
    args = parser.parse_args(argv)
    if min(args.runs, args.threads) < 1:
        parser.error("--runs and --threads must be at least 1")
    shape = Shape(PARALLEL, CTX, args.threads)
    model_path = common.model_path(args.model)
    exe = common.llama_tool(LLAMA_SERVER, build=not args.no_build)
    banned = end_of_generation_tokens(model_path)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-chats-") as tmp:
        for i, side in abba(args.runs):
            run = run_side(side, exe, model_path, shape, args.max_foreign, banned, pathlib.Path(tmp))
            chats = run["many_chats"]
            print(
                f"run {i + 1}/{args.runs} {side:<12} later-turn TTFT p50 {1000 * chats['later_ttft_p50_s']:.0f} ms "
                f"(cached {chats['later_cached_tokens_p50']:.0f} of {chats['later_prompt_tokens_p50']:.0f}), "
                f"alternating repeats {1000 * run['alternating']['p50_s']:.0f} ms",
                flush=True,
            )
            runs.append(run)
    summary = summarise_metrics(runs, ROWS)
    info = {"threads": args.threads, "git": common.git_version(), "llama_cpp": common.llama_pin()}
    table = markdown(summary, args.runs, info)
    print()
    print(table)
    (common.RESULTS_DIR / "chats.md").write_text(table + "\n", encoding="utf-8")
    path = common.write_results(
        "chats",
        {
            "benchmark": "chats",
            "measures": MEASURES,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **info,
            "machine": common.machine_info(),
            "model": str(model_path),
            "runs": runs,
            "summary": summary,
        },
    )
    print(f"\nwrote {path.relative_to(common.REPO_ROOT)} and chats.md")


if __name__ == "__main__":
    main()
