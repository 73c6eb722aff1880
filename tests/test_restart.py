"""Hot restart (SIGHUP) of real server processes under load, and what systemd is told.

The server reads its model through a symlink, as a deployment that swaps model files would.
Clients open a new connection for every request (``tests/support/load.py``), so a refused
connection would be seen. Every process a restart leaves behind is adopted and reaped by the
test (``restarts_of``), so that its exit code is checked and none outlives the test.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from server.model_files import default_model_path
from tests.support.load import Load, Tally
from tests.support.models import renamed_copy, repoint
from tests.support.process import ServerProcess
from tests.support.restarts import NotifySocket, alive, hot_restart, restarts_of, wait_pid
from tests.support.waiting import wait_for

pytestmark = pytest.mark.server

# Hang guard for any single wait.
GUARD = 60.0
RENAMED = "llama-trio restart"
SMALL = ["--threads", "1", "--parallel", "1", "--ctx-size", "512"]


@pytest.fixture(scope="module")
def renamed_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, str]:
    """The default GGUF with another general.name: "a new model" a client can tell apart."""
    out = tmp_path_factory.mktemp("gguf") / "renamed.gguf"
    return out, renamed_copy(default_model_path(), out, RENAMED)


@pytest.fixture
def model_link(tmp_path: pathlib.Path) -> pathlib.Path:
    link = tmp_path / "model.gguf"
    link.symlink_to(default_model_path())
    return link


def model_card(url: str) -> dict[str, Any]:
    response = httpx.get(url + "/v1/models", timeout=GUARD)
    assert response.status_code == 200
    (card,) = response.json()["data"]
    return dict(card)


def assert_clean(tally: Tally, log: str) -> None:
    assert "Traceback" not in log, log[-5000:]
    assert tally.refused == 0, tally
    assert tally.failures == [], tally


def test_hot_restart_under_load_through_a_new_model(
    model_link: pathlib.Path, renamed_model: tuple[pathlib.Path, str]
) -> None:
    """Two SIGHUP restarts under load, the second after the model file was replaced: no
    request fails, no connection is refused, each old process exits 0, and a client sees the
    new process (a later ``created``) and the new model's name."""
    args = ["--model", str(model_link), "--threads", "1", "--parallel", "2", "--ctx-size", "1024"]
    with ServerProcess([*args, "--drain-timeout", "20"]) as proc, restarts_of(proc):
        proc.wait_ready()
        first = model_card(proc.url)
        renamed, new_name = renamed_model
        assert first["meta"]["name"] != new_name
        with Load(proc.url, clients=4) as load:
            load.wait_for_answers(8, GUARD)
            # A later `created` needs a later second (the card's time is whole seconds).
            wait_for(lambda: time.time() >= first["created"] + 1, "the next second", GUARD)
            middle_pid = hot_restart(proc, proc.proc.pid, GUARD)
            assert proc.wait(GUARD) == 0, proc.log
            load.wait_for_answers(8, GUARD)
            middle = model_card(proc.url)
            assert middle["created"] > first["created"]
            assert middle["meta"] == first["meta"]

            repoint(model_link, renamed)
            wait_for(lambda: time.time() >= middle["created"] + 1, "the next second", GUARD)
            last_pid = hot_restart(proc, middle_pid, GUARD)
            assert wait_pid(middle_pid, GUARD) == 0, proc.log
            load.wait_for_answers(8, GUARD)
        tally = load.tally
        last = model_card(proc.url)
        assert last["created"] > middle["created"]
        assert last["meta"] == {"name": new_name}
        assert not alive(proc.proc.pid) and not alive(middle_pid)
        os.kill(last_pid, signal.SIGTERM)
        assert wait_pid(last_pid, GUARD) == 0, proc.log
    print(tally)
    assert_clean(tally, proc.log)
    assert tally.answered >= 24 and tally.streamed > 0
    for old, new in ((proc.proc.pid, middle_pid), (middle_pid, last_pid)):
        assert f"hot restart: process {old} started process {new}" in proc.log
        assert f"hot restart: process {new} is ready; process {old} hands over and drains" in proc.log


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``signum`` (/proc's SigCgt)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def test_a_sighup_while_the_process_starts_is_a_hot_restart_once_it_listens() -> None:
    """A SIGHUP that comes before the lifecycle listens for signals (the start's imports, a
    second or two on a small machine) ended the process without a word. It is held, then
    handled: a hot restart once the server is up."""
    with ServerProcess(SMALL) as proc, restarts_of(proc):
        # The model's load begins before the server's imports, and logs its start at once.
        wait_for(lambda: ": 0%" in proc.log, "the model's load to begin", GUARD)
        assert "listening on" not in proc.log  # still starting
        assert _catches(proc.proc.pid, signal.SIGHUP)
        proc.send_signal(signal.SIGHUP)
        ready = re.compile(rf"hot restart: process (\d+) is ready; process {proc.proc.pid} hands over")
        wait_for(lambda: ready.search(proc.log), "the hot restart", GUARD)
        assert proc.wait(GUARD) == 0, proc.log
        match = ready.search(proc.log)
        assert match is not None
        new_pid = int(match.group(1))
        assert httpx.get(proc.url + "/health", timeout=GUARD).status_code == 200  # the new process
        os.kill(new_pid, signal.SIGTERM)
        assert wait_pid(new_pid, GUARD) == 0, proc.log
    assert "Traceback" not in proc.log


def test_a_pooled_client_loses_no_request_to_a_hot_restart() -> None:
    """Found by review: a client that keeps its connection (as the SDKs pool them) sent its next
    request on the old process's connection as it closed, and the drain's lingering close read
    and dropped it ("Server disconnected without sending a response"). An answer written once
    the drain began says ``Connection: close``: the next request opens a new connection."""
    body = {"messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 40}
    with ServerProcess(SMALL) as proc, restarts_of(proc):
        proc.wait_ready()
        statuses: list[int | str] = []
        closing: list[str] = []
        restarted = threading.Event()

        def requests() -> None:  # back to back on one pooled connection, through the hand-over
            with httpx.Client(base_url=proc.url, timeout=GUARD) as client:
                after = 0
                while after < 2 and len(statuses) < 40:
                    after += restarted.is_set()
                    try:
                        answer = client.post("/v1/chat/completions", json=body)
                    except httpx.HTTPError as exc:
                        statuses.append(repr(exc))
                        continue
                    statuses.append(answer.status_code)
                    closing.append(answer.headers.get("connection", ""))

        client = threading.Thread(target=requests)
        client.start()
        wait_for(lambda: len(statuses) >= 1, "the first answer", GUARD)
        new_pid = hot_restart(proc, proc.proc.pid, GUARD)
        restarted.set()
        client.join(GUARD * 2)
        assert set(statuses) == {200}, statuses
        assert "close" in closing  # an answer of the old process's drain
        assert proc.wait(GUARD) == 0, proc.log
        os.kill(new_pid, signal.SIGTERM)
        assert wait_pid(new_pid, GUARD) == 0, proc.log
    assert "Traceback" not in proc.log


def test_ctrl_c_while_the_process_starts_exits_without_a_traceback() -> None:
    """Found by review: a SIGINT during the start's imports (Ctrl-C, which reaches a hot
    restart's starting process too) ended it with a KeyboardInterrupt traceback."""
    with ServerProcess(SMALL) as proc:
        wait_for(lambda: ": 0%" in proc.log, "the model's load to begin", GUARD)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(GUARD) in (0, 130)  # 0 if the lifecycle listened first: a drain
    assert "Traceback" not in proc.log and "KeyboardInterrupt" not in proc.log


def test_failed_hot_restart_keeps_the_old_process_serving(model_link: pathlib.Path) -> None:
    """The new copy cannot load its model (the file is gone): the old process logs why, tells
    systemd it is ready again and serves on, and no request fails. A second SIGHUP while the
    first restart is in progress is ignored, with a log line."""
    with NotifySocket() as notify:
        env = {"NOTIFY_SOCKET": notify.address}
        with ServerProcess(["--model", str(model_link), *SMALL], env=env) as proc:
            proc.wait_ready()
            assert notify.receive(GUARD)["READY"] == "1"
            with Load(proc.url, clients=2) as load:
                load.wait_for_answers(4, GUARD)
                model_link.unlink()
                proc.send_signal(signal.SIGHUP)
                started = re.compile(rf"hot restart: process {proc.proc.pid} started process (\d+)")
                wait_for(lambda: started.search(proc.log), "the new process to start", GUARD)
                proc.send_signal(signal.SIGHUP)
                wait_for(lambda: "SIGHUP ignored: a hot restart is already in progress" in proc.log, "the log", GUARD)
                failed = re.compile(
                    rf"hot restart failed: process (\d+) exited with code 1 before it was ready; "
                    rf"process {proc.proc.pid} keeps serving"
                )
                wait_for(lambda: failed.search(proc.log), "the failed restart in the log", GUARD)
                load.wait_for_answers(4, GUARD)
            match = started.search(proc.log)
            assert match is not None
            assert not alive(int(match.group(1))), "the failed process was not reaped"
            reloading = notify.receive(GUARD)
            assert reloading["RELOADING"] == "1" and int(reloading["MONOTONIC_USEC"]) > 0
            ready_again = notify.receive(GUARD)
            assert ready_again["READY"] == "1" and ready_again["STATUS"].startswith("hot restart failed: ")
            assert proc.stop() == 0
            assert notify.receive(GUARD)["STOPPING"] == "1"
    assert_clean(load.tally, proc.log)


def test_hot_restart_not_ready_in_time_is_abandoned() -> None:
    """A new process that is not ready within --restart-timeout is killed and reaped; the old
    one serves on. (No server starts and loads its model in 0.1 s.)"""
    with ServerProcess([*SMALL, "--restart-timeout", "0.1"]) as proc:
        proc.wait_ready()
        proc.send_signal(signal.SIGHUP)
        failed = re.compile(
            rf"hot restart failed: process (\d+) was not ready within 0.1 s; process {proc.proc.pid} keeps serving"
        )
        wait_for(lambda: failed.search(proc.log), "the failed restart in the log", GUARD)
        match = failed.search(proc.log)
        assert match is not None
        assert not alive(int(match.group(1)))
        assert httpx.get(proc.url + "/health", timeout=GUARD).status_code == 200
        assert proc.stop() == 0
    assert "Traceback" not in proc.log, proc.log[-5000:]


def test_sd_notify_ready_reloading_handover_stopping() -> None:
    """systemd is told, in order: READY=1; RELOADING=1 (with MONOTONIC_USEC) at SIGHUP;
    READY=1, then MAINPID=<the new process>, at the hand-over; STOPPING=1 when the new one is
    stopped. The old process says nothing more once it has handed over."""
    with NotifySocket() as notify:
        with ServerProcess(SMALL, env={"NOTIFY_SOCKET": notify.address}) as proc, restarts_of(proc):
            proc.wait_ready()
            ready = notify.receive(GUARD)
            assert ready["READY"] == "1" and ready["STATUS"] == f"serving on 127.0.0.1:{proc.port}"
            new_pid = hot_restart(proc, proc.proc.pid, GUARD)
            reloading = notify.receive(GUARD)
            assert reloading["RELOADING"] == "1"
            assert 0 < int(reloading["MONOTONIC_USEC"]) <= time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
            assert notify.receive(GUARD)["READY"] == "1"  # the reload is over
            assert notify.receive(GUARD) == {"MAINPID": str(new_pid)}
            assert proc.wait(GUARD) == 0
            assert not notify.pending(), "the old process notified after its hand-over"
            assert httpx.get(proc.url + "/health", timeout=GUARD).status_code == 200
            os.kill(new_pid, signal.SIGTERM)
            assert notify.receive(GUARD)["STOPPING"] == "1"
            assert wait_pid(new_pid, GUARD) == 0
            assert not notify.pending()
    assert "Traceback" not in proc.log, proc.log[-5000:]
