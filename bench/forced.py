"""Fast-forward measured: how much of a constrained answer its grammar forces, and the time per
answer with fast-forward and without (``--no-fast-forward``). Two servers (one each way) run
side by side; requests alternate between them one at a time (ABBA by round), greedy, not
streamed, so each answer has the machine to itself apart from other processes. Prints a
markdown table of medians; ``docs/engine.md`` holds a run.

    python -m bench.forced [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import httpx

from bench.support.workload import JSON_FORMAT
from tests.support.process import NO_END_TOKENS, ServerProcess

SERVER_ARGS = ["--parallel", "4", "--ctx-size", "4096", "--threads", "2"]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
QUESTION = "Explain how a refrigerator keeps food cold, step by step, for a curious twelve-year-old."
# (what, request body): the benchmark's json_schema row (runs to max_tokens, as free text does
# beside it), the issue's {name, age} as clients send it, and a call of a two-parameter tool.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("numbers (bench json_schema row, 128 tokens)", {"response_format": JSON_FORMAT, "max_tokens": 128}),
    (
        "person {name, age}",
        {
            "messages": [{"role": "user", "content": "Describe a fictional person as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
            "max_tokens": 100,
        },
    ),
    (
        "tool call (generic scheme, 2 parameters, required)",
        {
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [WEATHER],
            "tool_choice": "required",
            "max_tokens": 100,
        },
    ),
    ("free text (128 tokens)", {"logit_bias": NO_END_TOKENS, "max_tokens": 128}),
]
SIDES = ("fast-forward", "token by token")


def one(server: ServerProcess, body: dict[str, Any]) -> dict[str, float]:
    """One answer: its seconds, completion tokens, and the decode steps and forced tokens it took."""
    before = server.metrics()
    payload = {"messages": [{"role": "user", "content": QUESTION}], "temperature": 0, **body}
    started = time.perf_counter()
    response = httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=600)
    seconds = time.perf_counter() - started
    response.raise_for_status()
    after = server.metrics()

    def delta(name: str) -> float:
        return after[f"llama_trio_{name}_total"] - before[f"llama_trio_{name}_total"]

    return {
        "seconds": seconds,
        "tokens": response.json()["usage"]["completion_tokens"],
        "steps": delta("decode_steps"),
        "forced": delta("forced_tokens"),
        "sampled": delta("constrained_tokens"),
        "grammar_seconds": delta("constraint_seconds"),
    }


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _grammar_us(runs: list[dict[str, float]]) -> str:
    """Grammar work (masks, grammar steps, forced runs) per sampled constrained token."""
    sampled = sum(r["sampled"] for r in runs)
    return f"{1e6 * sum(r['grammar_seconds'] for r in runs) / sampled:.0f}" if sampled else "-"


def table(results: dict[tuple[str, str], list[dict[str, float]]]) -> str:
    lines = [
        "| answer | tokens | forced | decode steps (ff / off) | grammar us per sampled token (ff / off) "
        "| ms per answer (ff / off) | off / ff |",
        "|---|---|---|---|---|---|---|",
    ]
    for what, _ in CASES:
        on, off = results[(what, SIDES[0])], results[(what, SIDES[1])]
        tokens, forced = _median(on, "tokens"), _median(on, "forced")
        t_on, t_off = 1000 * _median(on, "seconds"), 1000 * _median(off, "seconds")
        lines.append(
            f"| {what} | {tokens:.0f} | {forced:.0f} ({forced / tokens:.0%}) | "
            f"{_median(on, 'steps'):.0f} / {_median(off, 'steps'):.0f} | {_grammar_us(on)} / {_grammar_us(off)} | "
            f"{t_on:.0f} / {t_off:.0f} | {t_off / t_on:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="answers per case and side (alternating)")
    args = parser.parse_args()
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    with (
        ServerProcess(SERVER_ARGS) as on,
        ServerProcess([*SERVER_ARGS, "--no-fast-forward"]) as off,
    ):
        servers = {SIDES[0]: on.wait_ready(), SIDES[1]: off.wait_ready()}
        for _, body in CASES:  # warm-up: grammars compiled, prompts cached
            for server in servers.values():
                one(server, body)
        for i in range(args.rounds):
            order = SIDES if i % 4 in (0, 3) else SIDES[::-1]
            for what, body in CASES:
                for side in order:
                    results.setdefault((what, side), []).append(one(servers[side], body))
            print(f"round {i + 1}/{args.rounds} done", flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
