"""Steady client load for restart tests: a few threads sending chat completions back to back,
every answer checked, every failure counted.

Each request opens a new connection (no keep-alive), so a restart that refuses connections
is seen, and counted apart from other failures. Streamed and whole answers alternate; a
stream must be complete and well-formed (chunks, one finish reason, ``[DONE]``, no error
event), a whole answer a 200 with a finish reason.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support import sse

PROMPTS = ["Name a color.", "Say hello.", "Count to three.", "Name a fruit."]
FINISHED = {"stop", "length"}


@dataclass
class Tally:
    """What the clients saw: complete answers, refused connections, other failures."""

    answered: int = 0
    streamed: int = 0
    refused: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return self.answered + self.refused + len(self.failures)

    def __str__(self) -> str:
        return (
            f"{self.requests} requests: {self.answered} answered ({self.streamed} streamed), "
            f"{self.refused} refused, {len(self.failures)} failed"
        )


class Load:
    """``clients`` threads sending requests to ``url`` until ``stop``; use as a context manager.

    ``wait_for_answers(n)`` waits for ``n`` more complete answers; ``tally`` counts them all.
    """

    def __init__(self, url: str, *, clients: int = 4, max_tokens: int = 8, timeout: float = 120.0) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.timeout = timeout
        self.tally = Tally()
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> Tally:
        """Let every client finish its request in progress; the tally."""
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout + 10)
            assert not thread.is_alive(), "a client did not finish its request"
        return self.tally

    def wait_for_answers(self, count: int, timeout: float) -> None:
        with self._lock:
            target = self.tally.answered + count
            ok = self._lock.wait_for(lambda: self.tally.answered >= target or self._stop.is_set(), timeout)
        assert ok, f"not {count} more answers within {timeout:g} s: {self.tally}"

    def _client(self, index: int) -> None:
        limits = httpx.Limits(max_keepalive_connections=0)  # a new connection per request
        with httpx.Client(base_url=self.url, timeout=self.timeout, limits=limits) as client:
            n = index
            while not self._stop.is_set():
                stream = n % 2 == 0
                body = {
                    "messages": [{"role": "user", "content": PROMPTS[n % len(PROMPTS)]}],
                    "max_tokens": self.max_tokens,
                    "stream": stream,
                }
                n += 1
                try:
                    self._request(client, body)
                except httpx.ConnectError:
                    with self._lock:
                        self.tally.refused += 1
                except Exception as exc:  # a failure of the server, recorded for the test
                    with self._lock:
                        self.tally.failures.append(f"{time.strftime('%H:%M:%S')} {type(exc).__name__}: {exc}"[:2000])
                else:
                    with self._lock:
                        self.tally.answered += 1
                        self.tally.streamed += stream
                        self._lock.notify_all()

    def _request(self, client: httpx.Client, body: dict[str, Any]) -> None:
        if body["stream"]:
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                raw = response.read()
            assert response.status_code == 200, (response.status_code, raw[:500])
            parsed = sse.parse(raw, kind="chat")
            reasons = parsed.finish_reasons
            assert len(reasons) == 1 and reasons[0] in FINISHED, raw[-500:]
            return
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, (response.status_code, response.text[:500])
        answer = response.json()
        assert answer["object"] == "chat.completion", answer
        assert answer["choices"][0]["finish_reason"] in FINISHED, answer
        assert isinstance(answer["choices"][0]["message"]["content"], str), answer
