"""What the serving benchmark asks of both servers: its shape, the concurrency levels and token
counts, the questions, the two-turn chats' system prompt, the json_schema format; and
``Session``, which numbers each request's conversation so that no two prompts share more than a
few tokens (neither server answers from its prompt cache unless a measurement means it to).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench import common
from bench.support.client import StreamResult, chat_body, stream_chat
from bench.support.servers import Launched

PARALLEL = 16  # sequences (slots) on both servers, for every concurrency level
CTX = 8192  # KV cells in all: 512 per sequence
CONCURRENCY = (1, 4, 16)
TTFT_CONCURRENCY = (1, 4)
BUSY_TTFT_CONCURRENCY = 4  # TTFT with a busy neighbour (one core kept busy by another process)
# The fast model (bench/random_model.py's "tiny": a decode step of a few ms, so that what each
# server does per token shows), on FAST_THREADS threads, FAST_MAX_TOKENS per request.
FAST_SHAPE = "tiny"
FAST_CONCURRENCY = (1, 4, 16)
FAST_MAX_TOKENS = 256
FAST_THREADS = 1
JSON_CONCURRENCY = (1, 4)
# Structured-output streams: an answer this schema allows is longer than MAX_TOKENS on both
# servers (at least 100 numbers), so every stream runs to MAX_TOKENS as the free ones do.
JSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "numbers",
        "schema": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 100},
    },
}
MAX_TOKENS = 128  # throughput requests
TTFT_MAX_TOKENS = 16
TURN1_MAX_TOKENS = 64
TURN2_MAX_TOKENS = 8
LONG_MAX_TOKENS = 384  # disconnect and SIGTERM streams: long enough to be cut mid-way

QUESTIONS = (
    "Explain how a refrigerator keeps food cold, step by step, for a curious twelve-year-old.",
    "Describe the water cycle and why it matters for farming, with a few concrete examples.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between a list and a tuple in Python, and when would you use each?",
    "Give practical advice for someone learning to cook simple, healthy meals at home.",
    "Summarise the history of the bicycle from its invention to the present day.",
    "Explain why the sky is blue and why sunsets are red, without using equations.",
    "Plan a relaxing weekend trip to the mountains for two people on a small budget.",
)
FOLLOW_UP = "Thank you. Now summarise your answer in one sentence."
# The system prompt of the two-turn chats: real assistants carry a few hundred tokens of
# instructions, and that shared prefix is what a second turn should not compute again (about
# 230 tokens here, so that both turns fit in a sequence's 512 cells).
CHAT_INSTRUCTIONS = " ".join(
    [
        "Answer in plain English, in short paragraphs, and keep a friendly, patient tone.",
        "When a question is ambiguous, say which reading you chose and why before answering.",
        "Prefer concrete examples over abstract statements, and numbers over vague words.",
        "Never invent sources, quotations, statistics or names; say so when you do not know.",
        "If the user asks for code, give a short, complete example and explain each part.",
        "If the user asks for a summary, keep it to the points that change a decision.",
        "Use metric units first and give imperial units in parentheses when they help.",
        "Avoid jargon; when a technical term is needed, define it the first time it appears.",
        "Check arithmetic twice and show the steps of any calculation that matters.",
        "Keep lists short: three to five items, each a full sentence with a verb.",
        "When safety is involved, such as electricity, chemicals or medicine, say so clearly.",
        "Do not repeat the question back; start with the answer, then give the reasons.",
        "If the user writes in another language, answer in that language.",
        "End with one question that would help the user go further, when it is useful.",
    ]
)


class Session:
    """One launched server and the requests sent to it; ``banned`` are the tokens every request
    biases away."""

    def __init__(self, server: Launched, banned: Sequence[int]) -> None:
        self.server = server
        self.port = server.port
        self.proc = server.proc
        self.banned = banned
        self._n = 0

    @property
    def number(self) -> int:
        """How many conversations this session has started."""
        return self._n

    def messages(self, question: str | None = None) -> list[dict[str, str]]:
        """A fresh conversation: a system message that starts with a request number."""
        self._n += 1
        q = question or QUESTIONS[self._n % len(QUESTIONS)]
        return [
            {"role": "system", "content": f"Request {self._n}. You are a helpful assistant."},
            {"role": "user", "content": q},
        ]

    async def chat(self, max_tokens: int, response_format: Any = None, **kw: Any) -> StreamResult:
        """A fresh conversation's streamed answer (``stream_chat``'s keywords pass through)."""
        body = chat_body(self.messages(), max_tokens, self.banned, response_format)
        return await stream_chat(self.port, body, **kw)

    async def send(self, messages: list[dict[str, str]], max_tokens: int) -> StreamResult:
        """The streamed answer to ``messages`` as they are."""
        return await stream_chat(self.port, chat_body(messages, max_tokens, self.banned))

    def cpu_seconds(self) -> float:
        return common.process_cpu_seconds(self.proc.pid)

    def cpu_watch(self) -> common.CpuWatch:
        """Other processes' load from now on (this server's own CPU use does not count)."""
        return common.CpuWatch([self.proc.pid])
