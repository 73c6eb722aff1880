"""The hot restart's handshake (``server/serve/restart.py``) without a server: a stand-in new
process is a few lines of Python that write on the ready pipe, or do not."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator

import pytest

from server.serve import restart

PIPE = "int(os.environ['LLAMA_TRIO_READY_FD'])"
# What report_ready writes.
SAY_READY = f"os.write({PIPE}, f'ready {{os.getpid()}}\\n'.encode())"


def stand_in(script: str) -> list[str]:
    return [sys.executable, "-c", f"import os, signal, time\n{script}"]


def reaped(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


@pytest.fixture
def listening() -> Iterator[socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock


async def test_a_new_process_that_says_ready_is_returned(listening: socket.socket) -> None:
    # It also sees the socket's descriptor, open, under LLAMA_TRIO_FD.
    script = f"os.fstat(int(os.environ['LLAMA_TRIO_FD']))\n{SAY_READY}\ntime.sleep(30)"
    process = await restart.start_successor(listening.fileno(), 10, command=stand_in(script))
    try:
        assert process.returncode is None
    finally:
        process.kill()
        await process.wait()


@pytest.mark.parametrize(
    ("script", "ready_within", "why"),
    [
        ("raise SystemExit(3)", 10, "exited with code 3 before it was ready"),
        ("os.kill(os.getpid(), signal.SIGKILL)", 10, "was killed by signal 9 before it was ready"),
        (f"os.write({PIPE}, b'nope\\n')\ntime.sleep(30)", 10, "said 'nope' instead of being ready"),
        ("time.sleep(30)", 0.2, "was not ready within 0.2 s"),
        (f"os.close({PIPE})\ntime.sleep(30)", 10, "closed its ready pipe without being ready"),
    ],
    ids=["exits", "killed", "wrong word", "late", "closes the pipe"],
)
async def test_a_new_process_that_is_not_ready_is_killed_and_reaped(
    listening: socket.socket, script: str, ready_within: float, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(restart, "EXIT_WAIT", 0.5)  # how long a closed pipe waits for an exit
    with pytest.raises(restart.RestartFailed, match=rf"^process \d+ {why}$") as failed:
        await restart.start_successor(listening.fileno(), ready_within, command=stand_in(script))
    pid = int(str(failed.value).split()[1])
    assert reaped(pid), "the failed process was not reaped"


async def test_a_command_that_cannot_start_fails_cleanly(listening: socket.socket) -> None:
    with pytest.raises(restart.RestartFailed, match="could not start /nonexistent/python"):
        await restart.start_successor(listening.fileno(), 10, command=["/nonexistent/python"])


def test_the_command_line_and_environment_of_the_new_process() -> None:
    assert restart.successor_command() == [sys.executable, *sys.orig_argv[1:]]
    env = restart.successor_env({"LLAMA_TRIO_FD": "9", "PATH": "/bin"}, 5, 7)
    assert env == {"LLAMA_TRIO_FD": "5", "LLAMA_TRIO_READY_FD": "7", "PATH": "/bin"}


def test_the_new_process_takes_its_ready_pipe_and_reports_once() -> None:
    read_end, write_end = os.pipe()
    env = {"LLAMA_TRIO_READY_FD": str(write_end), "OTHER": "1"}
    assert restart.take_ready_fd(env) == write_end and env == {"OTHER": "1"}
    assert not os.get_inheritable(write_end)
    restart.report_ready(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        assert pipe.read() == f"ready {os.getpid()}\n".encode()  # and the end: the pipe is closed
    assert restart.take_ready_fd({}) is None
    assert restart.take_ready_fd({"LLAMA_TRIO_READY_FD": "x"}) is None
    assert restart.take_ready_fd({"LLAMA_TRIO_READY_FD": str(write_end)}) is None  # closed now
