"""The serving benchmark's structured-output workloads beyond the free-text ones: answers whose
grammar forces much of the text (the records schema: keys, quotes, colons and braces are
forced, only the values are chosen) and tool calls (a two-parameter tool, ``tool_choice:
required``). Both servers get the same schema and the same tool; ours fast-forwards what the
grammar forces (``docs/engine.md``), llama-server samples it token by token.
"""

from __future__ import annotations

import json
import time
from typing import Any

import trio

from bench.support.client import StreamResult, stream_chat
from bench.support.workload import Session

# Records with declared keys (closed: llama-server's schema converter closes objects too): an
# answer this schema allows is longer than MAX_TOKENS on both servers (at least 40 records), so
# every stream runs to MAX_TOKENS as the free ones do. Values are short, so most tokens are keys.
RECORDS_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "records",
        "schema": {
            "type": "array",
            "minItems": 40,
            "items": {
                "type": "object",
                "properties": {
                    "identifier": {"type": "integer", "minimum": 0, "maximum": 99},
                    "available": {"type": "boolean"},
                    "category": {"enum": ["north", "south"]},
                },
                "required": ["identifier", "available", "category"],
                "additionalProperties": False,
            },
        },
    },
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TOOL_MAX_TOKENS = 96  # a call of this tool fits well within it on both servers
TOOL_QUESTIONS = (
    "What is the weather like in Paris today?",
    "Is it cold in Oslo right now?",
    "Tell me the temperature in Lisbon.",
    "How warm is it in Cairo at the moment?",
)


def tool_body(session: Session) -> bytes:
    """A streamed, greedy chat that must call the tool (no logit bias: the call ends the answer)."""
    question = TOOL_QUESTIONS[session.number % len(TOOL_QUESTIONS)]
    payload: dict[str, Any] = {
        "messages": session.messages(question),
        "temperature": 0,
        "max_tokens": TOOL_MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
    }
    return json.dumps(payload).encode()


def _calls(results: list[StreamResult], concurrency: int) -> int:
    """How many answers were tool calls; raises when a request failed outright. An answer in
    text instead (llama-server at this pin answers ``tool_choice: required`` with text for this
    model, with its own template and with a tools template alike) counts against the side."""
    for r in results:
        if r.failure or r.status != 200 or not r.well_formed:
            raise RuntimeError(
                f"tool calls at {concurrency}: a request failed: status={r.status} failure={r.failure} "
                f"finish={r.finish_reason} error={r.error}"
            )
    return sum(r.finish_reason == "tool_calls" for r in results)


async def measure_tool_calls(session: Session, concurrency: int, requests: int) -> dict[str, Any]:
    """``concurrency`` clients, each asking for ``requests`` tool calls one after another:
    calls per second (wall time from the first request to the end of the last; None unless
    every answer was a tool call) and each answer's milliseconds and completion tokens."""
    results: list[StreamResult] = []

    async def client() -> None:
        for _ in range(requests):
            results.append(await stream_chat(session.port, tool_body(session)))

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)
    wall = time.perf_counter() - start
    calls = _calls(results, concurrency)
    seconds = sorted((r.end or r.sent) - r.sent for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "tool_calls": calls,
        "calls_per_s": len(results) / wall if calls == len(results) else None,
        "ms_per_answer_p50": 1000 * seconds[len(seconds) // 2],
        "tokens_per_answer": sum(r.completion_tokens for r in results) / len(results),
        "wall_s": wall,
    }
