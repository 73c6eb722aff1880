"""Serving a listening socket handed over by someone else: systemd's socket activation with a
real server process, and the checks and parsing behind ``--fd`` without one.

With a socket handed to it, a server that stops closes only its own descriptor: connections
that arrive in the gap before the next server wait in the kernel's backlog, and are served by
the next one instead of being refused.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from server.net.listener import (
    SD_LISTEN_FDS_START,
    ListenError,
    inherited_listener,
    inherited_socket,
    systemd_fd,
)
from server.serve import sdnotify
from tests.support import sse
from tests.support.process import ServerProcess
from tests.support.rawhttp import dechunk, parse_head, request_bytes
from tests.support.waiting import wait_for

GUARD = 60.0
# What systemd does before it starts the service: the socket as descriptor 3, and
# LISTEN_PID / LISTEN_FDS naming the process that execs the server (so its pid is right).
ACTIVATE = """
import os, sys
fd = int(sys.argv[1])
os.dup2(fd, 3)
os.close(fd)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="1")
os.execv(sys.executable, [sys.executable, "-m", "server", *sys.argv[2:]])
"""


def activated(listener: socket.socket, *args: str) -> ServerProcess:
    port = listener.getsockname()[1]
    argv = [sys.executable, "-c", ACTIVATE, str(listener.fileno()), "--threads", "1", *args]
    return ServerProcess(argv=argv, port=port, pass_fds=(listener.fileno(),))


def send_request(port: int, body: dict[str, object]) -> socket.socket:
    """Connect and send one chat completion (``Connection: close``); the socket, to read the
    answer from later."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=GUARD)
    conn.sendall(request_bytes("POST", "/v1/chat/completions", body, headers={"Connection": "close"}))
    return conn


def read_answer(conn: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, headers = parse_head(head)
    if headers.get("transfer-encoding") == "chunked":
        body = dechunk(body)
    return status, headers, body


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """The test's own listening socket, as systemd's .socket unit would hold it."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as sock:
        yield sock


@pytest.mark.server
def test_socket_activation_keeps_clients_waiting_between_two_servers(listener: socket.socket) -> None:
    """The first server is stopped with SIGTERM; one client connects while it drains, another
    after it has exited; both wait, and the second server (same socket) answers both."""
    port = listener.getsockname()[1]
    small = ("--parallel", "2", "--ctx-size", "1024")
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
    with activated(listener, *small) as first:
        first.wait_ready()
        assert f"listening on http://127.0.0.1:{port} (a socket handed to us" in first.log
        with send_request(port, body) as conn:
            assert read_answer(conn)[0] == 200
        first.send_signal(signal.SIGTERM)
        wait_for(lambda: "shutting down: listener closed" in first.log, "the first server to stop accepting", GUARD)
        during = send_request(port, {**body, "stream": True})
        assert first.wait(GUARD) == 0, first.log
    after = send_request(port, body)
    with during, after, activated(listener, *small) as second:
        streamed = read_answer(during)
        assert streamed[0] == 200, streamed
        assert sse.parse(streamed[2], kind="chat").finish_reasons[0] in {"stop", "length"}
        whole = read_answer(after)
        assert whole[0] == 200, whole
        assert json.loads(whole[2])["choices"][0]["finish_reason"] in {"stop", "length"}
        second.wait_ready()
        assert second.stop() == 0
    for log in (first.log, second.log):
        assert "Traceback" not in log, log[-5000:]


@pytest.mark.server
def test_a_descriptor_that_is_not_a_listening_socket_is_refused_in_one_line() -> None:
    with socket.socket() as unbound:
        fd = unbound.fileno()
        argv = [sys.executable, "-m", "server", "--fd", str(fd)]
        result = subprocess.run(argv, pass_fds=(fd,), capture_output=True, text=True, timeout=GUARD)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"llama-trio: --fd {fd}: descriptor {fd} is a TCP socket that is not listening"
    ]


# -- without a server ---------------------------------------------------------------------------


def test_inherited_listener_checks_the_descriptor(listener: socket.socket) -> None:
    duplicate = os.dup(listener.fileno())
    sock = inherited_listener(duplicate, "--fd")
    with sock:
        assert sock.fileno() == duplicate and not sock.getblocking() and not os.get_inheritable(duplicate)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        with pytest.raises(ListenError, match=rf"^--fd {udp.fileno()}: descriptor {udp.fileno()} is not a TCP socket$"):
            inherited_listener(udp.fileno(), f"--fd {udp.fileno()}")
        assert udp.fileno() >= 0  # left as it was
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
        unix.bind(f"\0llama-trio-test-unix-{os.getpid()}")
        unix.listen()
        with pytest.raises(ListenError, match="is not a TCP socket"):
            inherited_listener(unix.fileno(), "x")
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(ListenError, match=rf"^x: descriptor {read_end} is not an open socket \("):
            inherited_listener(read_end, "x")
    finally:
        os.close(read_end)
        os.close(write_end)
    with pytest.raises(ListenError, match=rf"descriptor {read_end} is not an open socket \(Bad file descriptor\)"):
        inherited_listener(read_end, "x")


def test_systemd_fd_reads_and_removes_the_activation_variables() -> None:
    env = {"LISTEN_PID": "42", "LISTEN_FDS": "1", "LISTEN_FDNAMES": "http", "OTHER": "1"}
    assert systemd_fd(env, 42) == SD_LISTEN_FDS_START
    assert env == {"OTHER": "1"}
    env = {"LISTEN_PID": "41", "LISTEN_FDS": "1"}
    assert systemd_fd(env, 42) is None, "meant for another process"
    assert env == {}
    assert systemd_fd({"LISTEN_PID": "42", "LISTEN_FDS": "0"}, 42) is None
    assert systemd_fd({}, 42) is None
    with pytest.raises(ListenError, match="socket activation passed 2 sockets; llama-trio serves one"):
        systemd_fd({"LISTEN_PID": "42", "LISTEN_FDS": "2"}, 42)
    with pytest.raises(ListenError, match="are not numbers"):
        systemd_fd({"LISTEN_PID": "x", "LISTEN_FDS": "1"}, 42)


def test_inherited_socket_prefers_the_flag_and_clears_the_variables(listener: socket.socket) -> None:
    env = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "1"}
    sock = inherited_socket(os.dup(listener.fileno()), env)
    assert sock is not None and env == {}
    sock.close()
    assert inherited_socket(None, {}) is None


def test_sd_notify_addresses_and_messages() -> None:
    assert sdnotify.notify_address("@name") == "\0name"
    assert sdnotify.notify_address("/run/systemd/notify") == "/run/systemd/notify"
    assert sdnotify.notify_address("") is None
    assert sdnotify.notify_address(None) is None
    assert sdnotify.notify_address("vsock:2:1234") is None
    assert sdnotify.message("READY=1", "STATUS=two\nlines") == b"READY=1\nSTATUS=two lines"
    assert sdnotify.notify("READY=1", env={}) is False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(f"\0llama-trio-test-notify-{os.getpid()}")
        assert sdnotify.notify("READY=1", "STATUS=ok", env={"NOTIFY_SOCKET": f"@llama-trio-test-notify-{os.getpid()}"})
        assert receiver.recv(100) == b"READY=1\nSTATUS=ok"
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": "@llama-trio-test-nobody"}) is False  # logged
