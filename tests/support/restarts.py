"""Hot restarts from the outside: adopting the server processes a restart leaves behind, sending
SIGHUP and following the log, and a test-owned ``NOTIFY_SOCKET``.

A hot restart's new process is a child of the old one; when the old one exits it would be
reparented to PID 1. ``adopt_orphans`` makes the test process a child subreaper instead, so
such a process becomes the test's child: ``wait_pid`` reaps it and reads its exit code.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import time
import uuid
from collections.abc import Callable, Iterator

from tests.support.process import ServerProcess
from tests.support.waiting import POLL_S, wait_for

# prctl(2): PR_SET_CHILD_SUBREAPER.
_PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)
_STARTED = re.compile(r"hot restart: process \d+ started process (\d+)")


@contextlib.contextmanager
def adopt_orphans() -> Iterator[None]:
    """Within the block, descendants whose parent exits become this process's children."""
    if _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    try:
        yield
    finally:
        _libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


@contextlib.contextmanager
def restarts_of(proc: ServerProcess) -> Iterator[None]:
    """Within the block, the processes hot restarts of ``proc`` start are adopted when their
    parent exits (``adopt_orphans``); at its end every one of them still running is killed and
    reaped, so that none outlives a failed test."""
    with adopt_orphans():
        try:
            yield
        finally:
            family = {os.getpid(), proc.proc.pid}
            for pid in map(int, _STARTED.findall(proc.log)):
                # Only a process whose parent is still of the family: a pid reused by a stranger
                # is left alone.
                if alive(pid) and _parent(pid) in family:
                    family.add(pid)
                    os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):  # not ours: its parent reaps it
                    os.waitpid(pid, 0)


def wait_pid(pid: int, timeout: float) -> int:
    """Reap child ``pid`` (one adopted with ``adopt_orphans`` too): its exit code, or minus the
    signal that ended it. Fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not exit within {timeout:g} s")
        time.sleep(POLL_S)


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def restart_in_place(
    old: ServerProcess, args: list[str], timeout: float, *, while_down: Callable[[], bool] | None = None
) -> ServerProcess:
    """A plain restart, as a rolling restart does it: SIGTERM to ``old``, a new ``python -m
    server ARGS`` on its port as soon as it has stopped accepting (and, with ``while_down``, once
    that condition holds: the new process opens its port within ~50 ms of its start, too soon
    for a client to meet it closed by chance), ``old`` exits 0 and the new one is ready. Returns
    the new one; ``old`` is closed."""
    port = old.port
    old.send_signal(signal.SIGTERM)
    wait_for(lambda: "shutting down: listener closed" in old.log, "the old server to stop accepting", timeout)
    if while_down is not None:
        wait_for(while_down, "the closed port to be met", timeout)
    new = ServerProcess(args, port=port)
    try:
        assert old.wait(timeout) == 0, old.log
        assert "Traceback" not in old.log, old.log[-5000:]
        new.wait_ready(timeout)
    except BaseException:
        new.__exit__(None, None, None)
        raise
    finally:
        old.__exit__(None, None, None)
    return new


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None


def hot_restart(proc: ServerProcess, pid: int, timeout: float) -> int:
    """SIGHUP to server process ``pid`` (whose log ``proc`` reads); the new process's pid,
    once the old one has logged the hand-over. Fails when it logs a failed restart instead."""
    seen = len(proc.log)
    os.kill(pid, signal.SIGHUP)
    ready = re.compile(rf"hot restart: process (\d+) is ready; process {pid} hands over")

    def outcome() -> bool:
        log = proc.log[seen:]
        assert "hot restart failed" not in log, log
        return bool(ready.search(log))

    wait_for(outcome, f"process {pid}'s hot restart", timeout)
    match = ready.search(proc.log[seen:])
    assert match is not None
    return int(match.group(1))


class NotifySocket:
    """A datagram socket in the abstract namespace standing in for systemd's: ``address`` is
    the ``NOTIFY_SOCKET`` value, ``receive`` one notification as {KEY: VALUE}."""

    def __init__(self) -> None:
        self.address = f"@llama-trio-test-{uuid.uuid4().hex}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind("\0" + self.address[1:])

    def receive(self, timeout: float) -> dict[str, str]:
        self._sock.settimeout(timeout)
        data = self._sock.recv(4096)
        return dict(line.split("=", 1) for line in data.decode().split("\n"))

    def pending(self) -> bool:
        """Whether a notification is waiting (without taking it)."""
        self._sock.setblocking(False)
        try:
            self._sock.recv(4096, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        return True

    def __enter__(self) -> NotifySocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self._sock.close()
