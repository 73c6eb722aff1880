"""The agent APIs (``/v1/responses``, ``/v1/messages``) where serving matters: API keys (each
key its own stored responses; Anthropic's ``x-api-key``), the responses store's bound, a
stored response through a hot restart (``--responses-db``), and a SIGTERM drain that ends
each API's stream with its own terminal event."""

from __future__ import annotations

import os
import pathlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.support import sse
from tests.support.process import ServerProcess
from tests.support.restarts import hot_restart, restarts_of, wait_pid

pytestmark = pytest.mark.server

GUARD = 60.0  # hang guard for any single wait
KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
BOUND_MB = 0.02  # about 20 KB: a few responses with a long input
LONG = {  # an answer that cannot end before its token limit
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 9000}},
    "required": ["story"],
    "additionalProperties": False,
}
# About 3 KB of input, the same each time (its prefix is cached after the first request).
FILLER = " ".join(f"Item {i} is on the shelf." for i in range(120))


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, pathlib.Path]]:
    """A server with two API keys and a small store in a file (two threads: nothing on it is
    timed, and the store test's prompts are long)."""
    db = tmp_path_factory.mktemp("store") / "responses.db"
    args = ["--threads", "2", "--parallel", "2", "--ctx-size", "4096", "--api-key", KEY_A, "--api-key", KEY_B]
    with ServerProcess([*args, "--responses-db", str(db), "--responses-max-mb", str(BOUND_MB)]) as proc:
        proc.wait_ready()
        yield proc, db


def test_another_key_cannot_read_a_stored_response(keyed: tuple[ServerProcess, pathlib.Path]) -> None:
    proc, _ = keyed
    with client(proc.url, KEY_A) as a, client(proc.url, KEY_B) as b:
        created = a.responses.create(model="x", input="Hello.", max_output_tokens=2)
        for attempt in (
            lambda: b.responses.retrieve(created.id),
            lambda: b.responses.input_items.list(created.id),
            lambda: b.responses.delete(created.id),
            lambda: b.responses.create(model="x", input="More.", previous_response_id=created.id),
            lambda: b.responses.input_tokens.count(model="x", input="More.", previous_response_id=created.id),
        ):
            with pytest.raises(openai.NotFoundError):
                attempt()
        assert a.responses.retrieve(created.id).id == created.id  # still there, for its owner
    missing = httpx.post(proc.url + "/v1/responses", json={"input": "Hello."}, timeout=GUARD)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"


def test_anthropic_sdk_key_and_headers(keyed: tuple[ServerProcess, pathlib.Path]) -> None:
    proc, _ = keyed
    ask = [{"role": "user", "content": "Hello."}]
    beta = {"anthropic-beta": "token-efficient-tools-2025-02-19"}
    with anthropic.Anthropic(base_url=proc.url, api_key=KEY_B, max_retries=0, default_headers=beta) as sdk:
        assert sdk.messages.count_tokens(model="x", messages=ask).input_tokens > 0  # type: ignore[arg-type]
    with anthropic.Anthropic(base_url=proc.url, api_key="sk-wrong", max_retries=0) as sdk:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            sdk.messages.create(model="x", max_tokens=4, messages=ask)  # type: ignore[arg-type]
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid API key"},
    }


def test_store_bound_and_a_hot_restart(keyed: tuple[ServerProcess, pathlib.Path]) -> None:
    """The oldest responses go first and the newest stay within the bound; the new process of
    a hot restart reads and continues what the old one stored in the file."""
    proc, db = keyed
    with client(proc.url, KEY_A) as a:
        ids = [
            a.responses.create(model="x", input=f"{FILLER} Reply {i}.", max_output_tokens=1, metadata={"n": str(i)}).id
            for i in range(10)
        ]

        def kept() -> list[int]:
            found = []
            for i, id_ in enumerate(ids):
                try:
                    a.responses.retrieve(id_)
                except openai.NotFoundError:
                    continue
                found.append(i)
            return found

        before = kept()
        assert 2 <= len(before) < 10 and before == list(range(10 - len(before), 10))  # the newest, in a row
        last = a.responses.retrieve(ids[-1]).model_dump()
        with restarts_of(proc):
            new_pid = hot_restart(proc, proc.proc.pid, GUARD)
            assert proc.wait(GUARD) == 0, proc.log
            try:
                assert kept() == before  # the new process reads the same file
                assert a.responses.retrieve(ids[-1]).model_dump() == last
                more = a.responses.create(model="x", input="Thanks.", previous_response_id=ids[-1], max_output_tokens=1)
                items = a.responses.input_items.list(more.id, order="asc", limit=100).data
                assert len(items) == 3 and items[0].content[0].text.endswith("Reply 9.")  # type: ignore[union-attr]
            finally:
                os.kill(new_pid, signal.SIGTERM)
                assert wait_pid(new_pid, GUARD) == 0, proc.log
    assert db.exists() and "Traceback" not in proc.log, proc.log[-5000:]


def test_a_responses_db_it_cannot_open_fails_the_start(tmp_path: pathlib.Path) -> None:
    with ServerProcess(["--responses-db", str(tmp_path / "missing" / "responses.db")]) as proc:
        assert proc.wait(GUARD) == 2
    assert f"llama-trio: cannot open the responses store {tmp_path}/missing/responses.db" in proc.log
    assert "Traceback" not in proc.log


# -- the drain -----------------------------------------------------------------------------------


class RawStream(threading.Thread):
    """One streamed request through httpx in a thread: its whole body, and a signal at its
    first ``min_events`` events."""

    def __init__(self, url: str, body: dict[str, Any], min_events: int) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.min_events = url, body, min_events
        self.raw = b""
        self.error: BaseException | None = None
        self.started_ = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=GUARD) as response:
                assert response.status_code == 200
                for chunk in response.iter_bytes():
                    self.raw += chunk
                    if self.raw.count(b"\n\n") >= self.min_events:
                        self.started_.set()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.started_.set()


def test_sigterm_drain_ends_each_stream_with_its_terminal_event() -> None:
    args = ["--threads", "1", "--parallel", "2", "--ctx-size", "4608", "--drain-timeout", "1"]
    with ServerProcess(args) as proc:
        proc.wait_ready()
        form = {"type": "json_schema", "name": "story", "schema": LONG}
        ask = [{"role": "user", "content": "Tell a story."}]
        responses = RawStream(
            proc.url + "/v1/responses",
            {"input": "Tell a story.", "text": {"format": form}, "max_output_tokens": 2000, "stream": True},
            8,
        )
        messages = RawStream(
            proc.url + "/v1/messages",
            {
                "model": "x",
                "max_tokens": 2000,
                "messages": ask,
                "output_config": {"format": {"type": "json_schema", "schema": LONG}},
                "stream": True,
            },
            6,
        )
        for stream in (responses, messages):
            assert stream.started_.wait(GUARD) and stream.error is None, stream.error
        proc.send_signal(signal.SIGTERM)
        for stream in (responses, messages):
            stream.join(GUARD)
            assert stream.error is None, stream.error
        assert proc.wait(GUARD) == 0, proc.log

    events = sse.named_events(responses.raw)
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    name, failed = events[-1]
    assert name == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_shutting_down", "message": "server is shutting down"}
    assert [n for n, _ in events[-4:-1]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert failed["response"]["output"][0]["status"] == "incomplete"

    events = [e for e in sse.named_events(messages.raw, pings=None) if e[0] != "ping"]
    name, error = events[-1]
    assert name == "error" and error == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "server is shutting down"},
    }
    assert events[0][0] == "message_start" and "message_stop" not in [n for n, _ in events]
