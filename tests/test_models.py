"""Many models behind one server (``server/models/``): ids and aliases, load on demand,
``--models-max`` (never unloading a busy model), the wait queue's bound, idle unload, the
operators' load/unload routes, per-model metrics, and SIGTERM and disconnects during loads.

The extra models are small random-weight llamas with the default model's tokenizer
(``bench/random_model.py``): their text is noise, so the tests assert shapes, orders and
effects, and compare greedy answers only with other runs on this machine.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import threading
import time

import httpx
import pytest

from bench.random_model import SHAPES, write_model
from server.models.memory import available_memory
from tests.support import sse
from tests.support.process import NO_END_TOKENS, ServerProcess, serving
from tests.support.waiting import wait_for

BASE = ["--parallel", "2", "--ctx-size", "4096", "--threads", "1", "--cache-ram", "0"]

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory, model_path: pathlib.Path) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("models")
    write_model(model_path, folder / "tiny-a.gguf", SHAPES["tiny"], seed=1)
    write_model(model_path, folder / "tiny-b.gguf", SHAPES["tiny"], seed=2)
    return folder


def chat(url: str, model: str, max_tokens: int = 8, **extra: object) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": max_tokens}
    return httpx.post(url + "/v1/chat/completions", json={"temperature": 0, **body, **extra}, timeout=120)


def statuses(proc: ServerProcess) -> dict[str, str]:
    data = httpx.get(proc.url + "/v1/models", timeout=10).json()["data"]
    return {card["id"]: card["status"]["value"] for card in data}


def gauge(proc: ServerProcess, name: str, model: str) -> float:
    return proc.metrics().get(f"llama_trio_model_{name}{{model={model}}}", -1.0)


def rss_kib(proc: ServerProcess) -> int:
    for line in pathlib.Path(f"/proc/{proc.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_each_model_by_id_and_alias_loaded_on_demand(models_dir: pathlib.Path, model_path: pathlib.Path) -> None:
    preset = models_dir / "presets.ini"
    preset.write_text("[tiny-a]\naliases = first, primo\ntags = small, noise\nctx_size = 512\n")
    args = [*BASE, "--models-dir", str(models_dir), "--model", f"smol={model_path}", "--models-preset", str(preset)]
    with serving(args) as proc:
        assert statuses(proc) == {"smol": "unloaded", "tiny-a": "unloaded", "tiny-b": "unloaded"}
        cards = {c["id"]: c for c in httpx.get(proc.url + "/v1/models").json()["data"]}
        assert cards["tiny-a"]["aliases"] == ["first", "primo"]
        assert cards["tiny-a"]["tags"] == ["small", "noise"] and "tags" not in cards["tiny-b"]
        # OpenAI's retrieve call, by id or alias; an unknown name is a 404 in OpenAI's shape.
        for name in ("tiny-a", "primo"):
            assert httpx.get(f"{proc.url}/v1/models/{name}", timeout=10).json() == cards["tiny-a"]
        missing = httpx.get(proc.url + "/v1/models/nope", timeout=10)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        seen: set[str] = set()
        polling = threading.Event()

        def poll() -> None:
            while not polling.is_set():
                seen.add(statuses(proc)["tiny-b"])

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            for name in ("smol", "primo", "tiny-b"):
                answer = chat(proc.url, name)
                assert answer.status_code == 200, answer.text
                assert answer.json()["model"] == ("tiny-a" if name == "primo" else name)
        finally:
            polling.set()
            poller.join()
        assert statuses(proc) == {"smol": "loaded", "tiny-a": "loaded", "tiny-b": "loaded"}
        assert {"unloaded", "loaded"} <= seen, seen  # loading, too, when the poll catches it
        missing = chat(proc.url, "nope")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        assert missing.json()["error"]["param"] == "model"
        for name in ("smol", "tiny-a", "tiny-b"):
            assert gauge(proc, "loaded", name) == 1
            assert gauge(proc, "requests_running", name) == 0
            assert 0 < gauge(proc, "kv_cache_usage_ratio", name) <= 1


def test_a_load_does_not_disturb_another_models_stream(models_dir: pathlib.Path, model_path: pathlib.Path) -> None:
    args = [*BASE, "--models-dir", str(models_dir), "--model", f"smol={model_path}"]
    with serving(args) as proc:
        # Each request in a cache scope of its own: both are computed from scratch.
        alone = chat(proc.url, "smol", max_tokens=48, cache_salt="1").json()["choices"][0]["message"]["content"]
        body = {
            "cache_salt": "2",
            "model": "smol",
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": 48,
            "temperature": 0,
            "stream": True,
        }
        pieces: list[str] = []
        with httpx.stream("POST", proc.url + "/v1/chat/completions", json=body, timeout=120) as stream:
            lines = stream.iter_lines()
            for line in lines:
                if line.startswith("data: {") and '"content":"' in line:
                    break
            loaded = chat(proc.url, "tiny-a")  # loads tiny-a while smol streams
            assert loaded.status_code == 200
            text = [line for line in lines if line.startswith("data: ")]
        for line in text:
            if line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                pieces.append(delta.get("content") or "")
        # The stream's first content piece was read before the load; compare the rest as a suffix.
        assert alone.endswith("".join(pieces))
        assert statuses(proc)["tiny-a"] == "loaded"


def test_models_max_waits_for_a_busy_model_then_unloads_it(models_dir: pathlib.Path) -> None:
    args = [*BASE, "--models-dir", str(models_dir), "--models-max", "1", "--max-queue", "1"]
    with serving(args) as proc:
        assert chat(proc.url, "tiny-a").status_code == 200
        body = {"model": "tiny-a", "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 1500}
        a_ended: list[float] = []
        b_answer: list[httpx.Response] = []

        def stream_a() -> None:
            with httpx.stream(
                "POST", proc.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120
            ) as stream:
                for _ in stream.iter_lines():
                    pass
            a_ended.append(time.monotonic())

        def ask_b() -> None:
            b_answer.append(chat(proc.url, "tiny-b"))

        a = threading.Thread(target=stream_a)
        a.start()
        wait_for(lambda: gauge(proc, "requests_running", "tiny-a") == 1, "tiny-a to stream", 30)
        b = threading.Thread(target=ask_b)
        b.start()
        wait_for(lambda: gauge(proc, "requests_waiting", "tiny-b") == 1, "tiny-b's request to wait", 30)
        assert statuses(proc)["tiny-a"] == "loaded"  # busy: never unloaded from under its stream
        third = chat(proc.url, "tiny-b")  # the queue for room (--max-queue 1) is full
        assert third.status_code == 503, third.text
        assert third.json()["error"]["code"] == "models_busy"
        assert third.headers["Retry-After"] == "1"
        a.join(120)
        b.join(120)
        assert b_answer[0].status_code == 200, b_answer[0].text
        assert a_ended, "tiny-a's stream did not end"
        assert statuses(proc) == {"tiny-a": "unloaded", "tiny-b": "loaded"}


def test_a_disconnect_while_waiting_for_a_model_cancels_the_wait(models_dir: pathlib.Path) -> None:
    args = [*BASE, "--models-dir", str(models_dir), "--models-max", "1"]
    with serving(args) as proc:
        # A reader that stops reading keeps its stream busy (paused, not finished).
        body = {"model": "tiny-a", "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 1800}
        with httpx.stream("POST", proc.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as a:
            lines = a.iter_lines()
            next(lines)
            waiter = threading.Thread(target=lambda: _abandoned(proc.url, "tiny-b"))
            waiter.start()
            wait_for(lambda: gauge(proc, "requests_waiting", "tiny-b") == 1, "tiny-b's request to wait", 30)
            waiter.join(30)  # it gave up after 0.5 s
            wait_for(lambda: gauge(proc, "requests_waiting", "tiny-b") == 0, "the wait to end", 30)
            for _ in lines:
                pass
        time.sleep(0.5)
        assert statuses(proc) == {"tiny-a": "loaded", "tiny-b": "unloaded"}  # nobody wants it now


def _abandoned(url: str, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.5))


def test_idle_unload_frees_memory_and_loads_again(models_dir: pathlib.Path, model_path: pathlib.Path) -> None:
    args = [*BASE, "--model", f"smol={model_path}", "--model", f"tiny={models_dir / 'tiny-a.gguf'}"]
    with serving([*args, "--sleep-idle-seconds", "2"]) as proc:
        before = rss_kib(proc)
        assert chat(proc.url, "smol").status_code == 200
        loaded = rss_kib(proc)
        wait_for(lambda: statuses(proc)["smol"] == "unloaded", "smol to be unloaded when idle", 30)
        after = rss_kib(proc)
        assert loaded - after > (loaded - before) / 2, (before, loaded, after)
        assert chat(proc.url, "smol").status_code == 200  # loaded again on demand
        assert statuses(proc)["smol"] == "loaded"


def test_load_and_unload_routes(models_dir: pathlib.Path) -> None:
    args = [*BASE, "--models-dir", str(models_dir), "--api-key", "k"]
    key = {"Authorization": "Bearer k"}
    with serving(args) as proc:
        assert httpx.post(proc.url + "/models/load", json={"model": "tiny-a"}).status_code == 401
        loaded = httpx.post(proc.url + "/models/load", json={"model": "tiny-a"}, headers=key, timeout=60)
        assert loaded.status_code == 200 and loaded.json() == {"model": "tiny-a", "status": "loaded"}
        bad = httpx.post(proc.url + "/models/load", json={"model": "tiny-a", "x": 1}, headers=key)
        assert bad.status_code == 400
        missing = httpx.post(proc.url + "/models/unload", json={"model": "zzz"}, headers=key)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        body = {"model": "tiny-a", "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 300}
        with httpx.stream(
            "POST", proc.url + "/v1/chat/completions", json={**body, "stream": True}, headers=key, timeout=120
        ) as stream:
            lines = stream.iter_lines()
            next(lines)
            busy = httpx.post(proc.url + "/models/unload", json={"model": "tiny-a"}, headers=key)
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "model_busy"
            ended = [line for line in lines if line == "data: [DONE]"]
        assert ended == ["data: [DONE]"]  # the stream ran to its end
        done = httpx.post(proc.url + "/models/unload", json={"model": "tiny-a"}, headers=key)
        assert done.status_code == 200
        wait_for(
            lambda: httpx.get(proc.url + "/v1/models", headers=key).json()["data"][0]["status"]["value"] == "unloaded",
            "tiny-a to be unloaded",
            30,
        )


def test_with_an_admin_key_only_it_loads_and_unloads(models_dir: pathlib.Path) -> None:
    # Found by review: any tenant's key could unload the models of all of them.
    args = [*BASE, "--models-dir", str(models_dir), "--api-key", "tenant", "--admin-key", "ops"]
    tenant, ops = {"Authorization": "Bearer tenant"}, {"Authorization": "Bearer ops"}
    with serving(args) as proc:
        for path in ("/models/load", "/models/unload"):
            refused = httpx.post(proc.url + path, json={"model": "tiny-a"}, headers=tenant, timeout=60)
            assert refused.status_code == 403, refused.text
            assert refused.json()["error"]["code"] == "insufficient_permissions"
        assert httpx.post(proc.url + "/models/load", json={"model": "tiny-a"}, timeout=60).status_code == 401
        assert (
            httpx.post(proc.url + "/models/load", json={"model": "tiny-a"}, headers=ops, timeout=60).status_code == 200
        )
        body = {"model": "tiny-a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        for key in (tenant, ops):  # both keys are served
            answer = httpx.post(proc.url + "/v1/chat/completions", json=body, headers=key, timeout=60)
            assert answer.status_code == 200, answer.text
        assert httpx.post(proc.url + "/models/unload", json={"model": "tiny-a"}, headers=ops).status_code == 200


def test_sigterm_during_loads_exits_cleanly(models_dir: pathlib.Path) -> None:
    with ServerProcess([*BASE, "--models-dir", str(models_dir)]) as proc:
        proc.wait_ready()
        results: list[int] = []
        threads = [
            threading.Thread(target=lambda m=m: results.append(_status_or_0(proc.url, m))) for m in ("tiny-a", "tiny-b")
        ]
        for thread in threads:
            thread.start()
        wait_for(lambda: "tiny-" in proc.log, "a load to start", 30)
        assert proc.stop() == 0
        for thread in threads:
            thread.join(30)
        assert set(results) <= {0, 200, 503}, results
    assert "Traceback" not in proc.log, proc.log[-3000:]


def _status_or_0(url: str, model: str) -> int:
    try:
        return chat(url, model).status_code
    except httpx.TransportError:
        return 0


def test_a_model_whose_embedder_cannot_fit_fails_alone(models_dir: pathlib.Path, model_path: pathlib.Path) -> None:
    # Its engine's context fits; the embeddings context (batch-size x parallel cells) asks for
    # twice the memory left. The model fails with a 503 that says why, not the server (its
    # error escaped the runtime and ended the process), and the other models serve on.
    left = available_memory()
    assert left is not None
    parallel, per_cell = 256, 23040  # the default model's KV: 23040 bytes a cell in f16
    batch = -(-2 * left.bytes // (per_cell * parallel))
    preset = models_dir / "embed.ini"
    preset.write_text(f"[smol]\nembeddings = true\nparallel = {parallel}\nctx_size = {batch}\nbatch_size = {batch}\n")
    args = [*BASE, "--models-dir", str(models_dir), "--model", f"smol={model_path}", "--models-preset", str(preset)]
    with serving(args) as proc:
        refused = chat(proc.url, "smol")
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "model_load_failed" and "for its embeddings needs" in error["message"]
        assert str(models_dir) not in error["message"] and str(model_path.parent) not in error["message"]
        assert chat(proc.url, "tiny-a").status_code == 200
        assert proc.proc.poll() is None and "Traceback" not in proc.log


def test_a_chat_template_that_renders_nothing_fails_its_model_not_its_clients(models_dir: pathlib.Path) -> None:
    # Found by review: a template the operator gave that neither compiles in jinja2 nor is one
    # llama.cpp knows made every chat a 400 blaming the client ("cannot apply the chat template").
    preset = models_dir / "template.ini"
    preset.write_text("[tiny-a]\nchat_template = {% if %}\n")
    with serving([*BASE, "--models-dir", str(models_dir), "--models-preset", str(preset)]) as proc:
        refused = chat(proc.url, "tiny-a")
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "model_load_failed" and "neither compiles in jinja2" in error["message"]
        assert chat(proc.url, "tiny-b").status_code == 200
    assert "Traceback" not in proc.log
    # One model, the template on the command line: the start fails, saying why.
    with ServerProcess([*BASE, "--model", str(models_dir / "tiny-a.gguf"), "--chat-template", "{{ nope("]) as alone:
        assert alone.wait(60) == 1
    assert "the chat template neither compiles in jinja2" in alone.log and "Traceback" not in alone.log


def test_a_failed_load_tells_a_client_the_file_but_not_its_folder(tmp_path: pathlib.Path) -> None:
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(40))  # no architecture
    with serving([*BASE, "--models-dir", str(tmp_path)]) as proc:
        refused = chat(proc.url, "bad")
        assert refused.status_code == 503, refused.text
        message = refused.json()["error"]["message"]
        assert "bad.gguf" in message and str(tmp_path) not in message, message
        card = httpx.get(proc.url + "/v1/models", timeout=10).json()["data"][0]
        assert card["status"]["value"] == "failed" and "bad.gguf" in card["status"]["error"]
        assert str(tmp_path) not in card["status"]["error"]
        assert str(tmp_path) in proc.log  # the operator's log names the whole path


def test_a_model_larger_than_the_bound_is_refused_at_once(models_dir: pathlib.Path) -> None:
    # Both tiny models are 8 MiB: under a 1 MiB bound neither can ever load. The request is
    # answered now (not after --models-load-timeout), with no Retry-After.
    with serving([*BASE, "--models-dir", str(models_dir), "--models-max-mb", "1"]) as proc:
        refused = chat(proc.url, "tiny-a")
        assert refused.status_code == 503 and "retry-after" not in refused.headers, refused.headers
        error = refused.json()["error"]
        assert error["code"] == "model_too_large" and "--models-max-mb (1 MiB)" in error["message"], error
        assert "tiny-b" in proc.log and "larger than --models-max-mb" in proc.log  # said at start too


def test_an_operator_can_abort_a_load(tmp_path: pathlib.Path, model_path: pathlib.Path) -> None:
    # The model file is a pipe: its load waits for the test to write it, so it is surely under
    # way when the unload comes. Nobody waits for it (the client that asked has gone).
    pipe = tmp_path / "slow.gguf"
    os.mkfifo(pipe)
    with serving([*BASE, "--model", f"slow={pipe}", "--model", f"smol={model_path}"]) as proc:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(proc.url + "/models/load", json={"model": "slow"}, timeout=1)
        assert statuses(proc)["slow"] == "loading"
        unload = httpx.post(proc.url + "/models/unload", json={"model": "slow"}, timeout=10)
        assert unload.status_code == 200 and unload.json() == {"model": "slow", "status": "unloading"}
        with open(pipe, "wb") as writer:  # let the load go on: it finds it was aborted
            writer.write(b"GGUF")
        wait_for(lambda: statuses(proc)["slow"] == "unloaded", "the aborted load to end", 30)
        assert "model slow: load aborted on request" in proc.log
        assert chat(proc.url, "smol").status_code == 200


SHUTTING_DOWN = {
    "message": "server is shutting down",
    "type": "server_error",
    "param": None,
    "code": "server_shutting_down",
}


def test_sigterm_during_a_load_refuses_its_waiters_and_lets_loaded_models_finish(
    tmp_path: pathlib.Path, model_path: pathlib.Path
) -> None:
    # The slow model's file is a pipe (as above): its load is surely under way at the signal.
    # Its waiters (each family's) get the 503 that queued requests get, at once, rather than the
    # load's result; the stream on the model already loaded runs to its end in the drain; the
    # process exits as soon as that stream ends, not at --drain-timeout.
    pipe = tmp_path / "slow.gguf"
    os.mkfifo(pipe)
    args = [*BASE, "--model", f"slow={pipe}", "--model", f"smol={model_path}", "--drain-timeout", "60"]
    with ServerProcess(args) as proc:
        proc.wait_ready()
        body = {"model": "smol", "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 300}
        running: list[str] = []
        with httpx.stream(
            "POST",
            proc.url + "/v1/chat/completions",
            json={**body, "stream": True, "logit_bias": NO_END_TOKENS},
            timeout=120,
        ) as stream:
            lines = stream.iter_lines()
            running.append(next(lines))
            answers: dict[str, tuple[float, httpx.Response]] = {}
            waiters = [
                threading.Thread(target=_answered, args=(answers, name, proc.url + path, payload))
                for name, path, payload in (
                    ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                    (
                        "stream",
                        "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "Hi"}], "stream": True},
                    ),
                    ("messages", "/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
                )
            ]
            for waiter in waiters:
                waiter.start()
            wait_for(lambda: gauge(proc, "requests_waiting", "slow") == 3, "three requests waiting for slow", 30)
            assert statuses(proc)["slow"] == "loading"
            assert gauge(proc, "requests_running", "smol") == 1  # the stream runs on into the drain
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            for waiter in waiters:
                waiter.join(10)
            assert set(answers) == {"chat", "stream", "messages"}, f"still waiting: {answers.keys()}"
            for name, (at, answer) in answers.items():
                assert answer.status_code == 503, (name, answer.text)
                assert at - signalled < 1.0, f"{name} was answered {at - signalled:.2f} s after SIGTERM"
            assert answers["chat"][1].json() == {"error": SHUTTING_DOWN}
            assert answers["stream"][1].json() == {"error": SHUTTING_DOWN}  # refused before its answer began
            error = {"type": "overloaded_error", "message": "server is shutting down"}
            assert answers["messages"][1].json() == {"type": "error", "error": error}
            with open(pipe, "wb") as writer:  # let the load go on (it waits in open): it finds it was aborted
                writer.write(b"GGUF")
            running.extend(lines)
            ended = time.monotonic()
        assert proc.wait(60) == 0, proc.log[-3000:]
        exited = time.monotonic()
    payloads = [p for p in map(sse.data_of, running) if p is not None]
    assert payloads[-1] == "[DONE]" and sse.finish_reason(payloads[-2]) == "length", payloads[-3:]
    assert exited - ended < 2.0, f"exited {exited - ended:.2f} s after the last stream ended"
    assert exited - signalled < 30, f"exited {exited - signalled:.2f} s after SIGTERM"
    assert "model slow: load aborted: the server is shutting down" in proc.log
    assert "Traceback" not in proc.log, proc.log[-3000:]


def _answered(
    answers: dict[str, tuple[float, httpx.Response]], name: str, url: str, payload: dict[str, object]
) -> None:
    try:
        response = httpx.post(url, json={"model": "slow", "max_tokens": 4, **payload}, timeout=120)
    except httpx.TransportError:  # the server went away first: reported as never answered
        return
    answers[name] = (time.monotonic(), response)
