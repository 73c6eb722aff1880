"""Start, drain and stop of real server processes: real signals, curl, httpx and raw sockets.

Every server here runs with one llama.cpp thread (the machine has two cores and other tests
may run beside these). Streams that must outlast a drain ban SmolLM2's end tokens through
``logit_bias`` so that they cannot stop early. Timeouts on waits are hang guards, not
expectations; the expectations are the assertions on times measured from the signal.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tests.support import sse
from tests.support.ports import free_port, plain_bind, time_wait_on
from tests.support.process import NO_END_TOKENS, ServerProcess
from tests.support.rawhttp import http_get
from tests.support.waiting import wait_for

pytestmark = pytest.mark.server

SHUTTING_DOWN = {
    "message": "server is shutting down",
    "type": "server_error",
    "param": None,
    "code": "server_shutting_down",
}
# Hang guard for any single wait.
GUARD = 60.0
# Linux syscall number of pidfd_getfd (the same on every architecture since 5.6).
SYS_PIDFD_GETFD = 438
_libc = ctypes.CDLL(None, use_errno=True)


def server(*args: str, port: int = 0) -> ServerProcess:
    return ServerProcess(["--threads", "1", *args], port=port)


def chat_body(max_tokens: int, *, stream: bool = True, endless: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Tell me a story about a lighthouse."}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if endless:
        body["logit_bias"] = NO_END_TOKENS
    return body


# -- clients ----------------------------------------------------------------------------------


class CurlStream:
    """``curl -sN`` streaming one chat completion; every ``data:`` event is timestamped."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [
                *("curl", "-sN", "--max-time", str(GUARD), "-H", "Content-Type: application/json"),
                *("-d", json.dumps(body), url + "/v1/chat/completions"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.events: list[tuple[float, str]] = []
        self.raw: list[str] = []
        self.ended_at: float | None = None
        self.first_text = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for line in self.proc.stdout:
                self.raw.append(line)
                payload = sse.data_of(line)
                if payload is not None:
                    self.events.append((time.monotonic(), payload))
                    if sse.chunk_text(payload):
                        self.first_text.set()
        self.ended_at = time.monotonic()
        self.first_text.set()  # no waiter hangs on a stream that ended without text

    def finish(self) -> int:
        """Wait for the end of the body; curl's exit code (0: complete, 18: body cut short)."""
        self._reader.join(GUARD)
        return self.proc.wait(GUARD)

    def payloads(self) -> list[str]:
        return [payload for _, payload in self.events]

    def texts_after(self, moment: float) -> int:
        return sum(1 for at, payload in self.events if at > moment and sse.chunk_text(payload))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(GUARD)


def assert_ended_by_shutdown(stream: CurlStream) -> None:
    """The stream's last events are the shutting-down error and ``[DONE]``, and the body is
    complete (curl exits 0, not 18)."""
    assert stream.finish() == 0, "".join(stream.raw)
    payloads = stream.payloads()
    assert payloads[-1] == "[DONE]", payloads[-3:]
    assert json.loads(payloads[-2]) == {"error": SHUTTING_DOWN}, payloads[-3:]
    assert not any(sse.finish_reason(p) for p in payloads[:-1]), "a drained stream has no finish_reason"
    assert "".join(stream.raw).endswith("data: [DONE]\n\n")


@contextmanager
def curl_streams(url: str, body: dict[str, Any], count: int) -> Iterator[list[CurlStream]]:
    streams = [CurlStream(url, body) for _ in range(count)]
    try:
        yield streams
    finally:
        for stream in streams:
            stream.kill()


class HttpxStream(threading.Thread):
    """One streamed chat completion through httpx in a thread; events are timestamped. With
    ``client``, on that client's pooled connection, which stays open after the body (as an SDK's
    does) until the client is closed."""

    def __init__(self, url: str, body: dict[str, Any], *, client: httpx.Client | None = None) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.body = body
        self.client = client
        self.ended_at: float | None = None
        self.events: list[tuple[float, str]] = []
        self.error: BaseException | None = None
        self.first_text = threading.Event()
        self.start()

    def run(self) -> None:
        url = self.url + "/v1/chat/completions"
        try:
            with (self.client or httpx).stream("POST", url, json=self.body, timeout=GUARD) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    payload = sse.data_of(line)
                    if payload is not None:
                        self.events.append((time.monotonic(), payload))
                        if sse.chunk_text(payload):
                            self.first_text.set()
            self.ended_at = time.monotonic()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.first_text.set()


# -- sockets ------------------------------------------------------------------------------------


def connection_refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def live_listener(pid: int, port: int) -> socket.socket:
    """A duplicate of the listening socket of process ``pid`` on ``port``, taken with
    pidfd_getfd, so that its options are read from the live socket itself."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(f"socket:[{inode}]")
    assert inodes, f"nothing listens on port {port}"
    fd_dir = f"/proc/{pid}/fd"
    target = next(int(fd) for fd in os.listdir(fd_dir) if _readlink(f"{fd_dir}/{fd}") in inodes)
    pidfd = os.pidfd_open(pid)
    try:
        fd = _libc.syscall(SYS_PIDFD_GETFD, pidfd, target, 0)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "pidfd_getfd")
    finally:
        os.close(pidfd)
    return socket.socket(fileno=fd)


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


# -- 1. socket options --------------------------------------------------------------------------


def test_listener_options_read_from_the_live_socket() -> None:
    with server("--parallel", "1", "--ctx-size", "512") as proc:
        proc.wait_ready()
        with live_listener(proc.proc.pid, proc.port) as sock:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == 1
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 0
        assert proc.stop() == 0
    with server("--parallel", "1", "--ctx-size", "512", "--reuse-port") as proc:
        proc.wait_ready()
        with live_listener(proc.proc.pid, proc.port) as sock:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == 1
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
        assert proc.stop() == 0


# -- 2. restart on the same port ----------------------------------------------------------------


def test_restart_on_the_same_port_right_after_sigint() -> None:
    old = server("--parallel", "1", "--ctx-size", "512")
    try:
        old.wait_ready()
        port = old.port
        for _ in range(3):
            stream = CurlStream(old.url, chat_body(8, endless=False))
            assert stream.finish() == 0
            assert stream.payloads()[-1] == "[DONE]"
            assert sse.finish_reason(stream.payloads()[-2]) in {"stop", "length"}
            old.send_signal(signal.SIGINT)
            new = server("--parallel", "1", "--ctx-size", "512", port=port)  # at once, not after the exit
            try:
                assert old.wait(GUARD) == 0, old.log
                new.wait_ready()
                assert f"listening on http://127.0.0.1:{port}" in new.log
            except BaseException:
                new.__exit__(None, None, None)
                raise
            old.__exit__(None, None, None)
            old = new
        assert old.stop() == 0
    finally:
        old.__exit__(None, None, None)


# -- 3. drain: in-flight streams finish, the listener is closed ---------------------------------


def test_sigterm_lets_streams_finish_and_refuses_new_connections() -> None:
    with server("--parallel", "3", "--ctx-size", "1536", "--drain-timeout", "30") as proc:
        proc.wait_ready()
        streams = [HttpxStream(proc.url, chat_body(60)) for _ in range(3)]
        for stream in streams:
            assert stream.first_text.wait(GUARD)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(max(0.0, signalled + 0.1 - time.monotonic()))
        assert connection_refused(proc.port), "a connection 100 ms after SIGTERM was accepted"
        for stream in streams:
            stream.join(GUARD)
            assert stream.error is None, repr(stream.error)
            payloads = [payload for _, payload in stream.events]
            assert payloads[-1] == "[DONE]"
            assert sse.finish_reason(payloads[-2]) == "length"
            assert not any("error" in json.loads(p) for p in payloads[:-1])
            assert sum(1 for at, p in stream.events if at > signalled and sse.chunk_text(p)) > 0, (
                "finished before the signal"
            )
        assert proc.wait(GUARD) == 0, proc.log


# -- 4. the drain deadline ends long streams with an error event --------------------------------


def test_drain_timeout_ends_streams_with_error_event_and_done() -> None:
    # 3 sequences of 2304 tokens: room for the prompt and 2000 generated tokens each.
    with server("--parallel", "3", "--ctx-size", "6912", "--drain-timeout", "1") as proc:
        proc.wait_ready()
        with curl_streams(proc.url, chat_body(2000), 3) as streams:
            for stream in streams:
                assert stream.first_text.wait(GUARD)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            deadline = signalled + 1.0
            for stream in streams:
                assert_ended_by_shutdown(stream)
                assert stream.ended_at is not None
                assert stream.ended_at <= deadline + 1.5, f"ended {stream.ended_at - deadline:.2f} s after the deadline"
                assert stream.ended_at >= deadline - 0.1, "ended before the drain deadline"
                assert stream.texts_after(signalled) > 0, "the stream did not run during the drain"
        assert proc.wait(GUARD) == 0, proc.log


def test_pooled_clients_do_not_hold_the_exit_past_the_final_write_grace() -> None:
    """Clients that keep their connection in a pool after ``[DONE]`` (every SDK does) never
    close it. After the drain deadline the server writes the final events, closes without
    waiting for those clients, and exits within the second given to final writes."""
    with server("--parallel", "2", "--ctx-size", "4608", "--drain-timeout", "1") as proc:
        proc.wait_ready()
        clients = [httpx.Client() for _ in range(2)]
        try:
            streams = [HttpxStream(proc.url, chat_body(2000), client=client) for client in clients]
            for stream in streams:
                assert stream.first_text.wait(GUARD)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(GUARD) == 0, proc.log
            exited = time.monotonic() - signalled
            for stream in streams:
                stream.join(GUARD)
                assert stream.error is None, stream.error
                payloads = [payload for _, payload in stream.events]
                assert payloads[-1] == "[DONE]", payloads[-3:]
                assert json.loads(payloads[-2]) == {"error": SHUTTING_DOWN}, payloads[-3:]
        finally:
            for client in clients:
                client.close()
    # 1 s of drain, then at most 1 s for final writes (server/serve/lifecycle.py's FINAL_WRITE_GRACE).
    assert exited <= 2.0, f"exited {exited:.2f} s after SIGTERM"


# -- 5. a second signal ends the drain at once --------------------------------------------------


def test_second_sigint_ends_the_drain_at_once() -> None:
    with server("--parallel", "2", "--ctx-size", "4608", "--drain-timeout", "30") as proc:
        proc.wait_ready()
        with curl_streams(proc.url, chat_body(2000), 2) as streams:
            for stream in streams:
                assert stream.first_text.wait(GUARD)
            first = time.monotonic()
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
            assert all(stream.ended_at is None for stream in streams), "the first signal ended a stream"
            second = time.monotonic()
            proc.send_signal(signal.SIGINT)
            for stream in streams:
                assert_ended_by_shutdown(stream)
                assert stream.ended_at is not None
                assert stream.ended_at - second <= 1.0, f"ended {stream.ended_at - second:.2f} s after the 2nd signal"
                assert stream.texts_after(first) > 0, "the stream did not run between the signals"
        assert proc.wait(GUARD) == 0, proc.log


# -- 6. queued requests end at once -------------------------------------------------------------


def test_at_sigterm_queued_requests_get_503_and_queued_streams_wait_for_a_sequence() -> None:
    """A queued non-streamed request ends at once with 503 (nothing was sent: a proxy may retry
    it elsewhere). A queued stream has sent its head and first chunk, which no proxy can take
    back, so it keeps its place and is answered once the running stream is done, in the drain."""
    with server("--parallel", "1", "--ctx-size", "2304", "--drain-timeout", "30") as proc:
        proc.wait_ready()
        with curl_streams(proc.url, chat_body(200), 1) as (running,):
            assert running.first_text.wait(GUARD)
            queued_stream = CurlStream(proc.url, chat_body(20))
            plain: dict[str, Any] = {}

            def non_streamed() -> None:
                url = proc.url + "/v1/chat/completions"
                response = httpx.post(url, json=chat_body(50, stream=False), timeout=GUARD)
                plain.update(status=response.status_code, body=response.json(), at=time.monotonic())

            waiter = threading.Thread(target=non_streamed, daemon=True)
            waiter.start()
            try:
                wait_for(lambda: proc.metrics().get("llama_trio_queue_depth") == 2, "two queued requests", GUARD)
                signalled = time.monotonic()
                proc.send_signal(signal.SIGTERM)

                waiter.join(GUARD)
                assert plain["status"] == 503
                assert plain["body"] == {"error": SHUTTING_DOWN}
                assert plain["at"] - signalled < 0.75

                assert queued_stream.finish() == 0
                payloads = queued_stream.payloads()
                assert payloads[-1] == "[DONE]" and sse.finish_reason(payloads[-2]) == "length", payloads[-3:]
                assert not any("error" in json.loads(p) for p in payloads[:-1])
                assert queued_stream.texts_after(signalled) > 0, "the queued stream was not decoded in the drain"
                assert running.finish() == 0
                assert sse.finish_reason(running.payloads()[-2]) == "length"
            finally:
                queued_stream.kill()
        assert proc.wait(GUARD) == 0, proc.log


# -- 7. a busy port -----------------------------------------------------------------------------


def test_busy_port_exits_nonzero_with_one_line() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "server", "--port", str(port), "--threads", "1"],
            capture_output=True,
            text=True,
            timeout=GUARD,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
    assert result.returncode != 0
    assert result.stdout == ""
    assert result.stderr.splitlines() == [f"llama-trio: cannot listen on 127.0.0.1:{port}: address already in use"]


# -- 8. /health on an open keep-alive connection ------------------------------------------------


def health(conn: socket.socket) -> tuple[int, str]:
    """``GET /health`` on an open connection: the status code and the body's ``status``."""
    code, body = http_get(conn, "/health")
    return code, json.loads(body)["status"]


def test_keep_alive_connection_at_drain_start_is_closed_cleanly_or_told_draining() -> None:
    """Observed: Hypercorn closes idle keep-alive connections as the drain starts (FIN, no
    RST), so a second /health on such a connection is never answered; were the connection
    still open, the answer must be 503 draining."""
    with server("--parallel", "1", "--ctx-size", "2304", "--drain-timeout", "1") as proc:
        proc.wait_ready()
        with (
            curl_streams(proc.url, chat_body(2000), 1) as (running,),
            socket.create_connection(("127.0.0.1", proc.port), timeout=GUARD) as conn,
        ):
            assert health(conn) == (200, "ok")
            assert running.first_text.wait(GUARD)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: connection_refused(proc.port), "the listener to close", timeout=5)
            readable, _, _ = select.select([conn], [], [], 1.0)
            if readable:
                assert conn.recv(1) == b"", "unexpected data on an idle connection"  # FIN: a clean close
                assert time.monotonic() - signalled < 1.0
            else:
                assert health(conn) == (503, "draining")
            assert_ended_by_shutdown(running)
        assert proc.wait(GUARD) == 0, proc.log


def test_a_connection_accepted_just_before_sigterm_is_answered_not_reset() -> None:
    """A client that has connected but not yet sent its request when the drain starts gets a
    moment (1 s) to send it, and an answer (503 draining) rather than a closed connection."""
    with server("--parallel", "1", "--ctx-size", "512") as proc:
        proc.wait_ready()
        with socket.create_connection(("127.0.0.1", proc.port), timeout=GUARD) as conn:
            client_port = conn.getsockname()[1]
            wait_for(lambda: accepted(proc.proc.pid, client_port), "the server to accept", GUARD)
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: connection_refused(proc.port), "the listener to close", timeout=5)
            assert health(conn) == (503, "draining")
        assert proc.wait(GUARD) == 0, proc.log


def accepted(pid: int, client_port: int) -> bool:
    """Whether process ``pid`` has accepted the connection from local port ``client_port``: the
    server's end of it (remote port ``client_port``) is one of its descriptors. Until it is
    accepted, that socket has no file (inode 0 in /proc/net/tcp)."""
    inodes = set()
    with open("/proc/net/tcp") as lines:
        next(lines)
        for line in lines:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == client_port and fields[9] != "0":
                inodes.add(f"socket:[{fields[9]}]")
    fd_dir = f"/proc/{pid}/fd"
    return any(_readlink(f"{fd_dir}/{fd}") in inodes for fd in os.listdir(fd_dir))


# -- 9. TIME_WAIT after exit --------------------------------------------------------------------


def test_no_time_wait_on_the_port_when_clients_closed_first() -> None:
    with server("--parallel", "1", "--ctx-size", "512") as proc:
        proc.wait_ready()
        port = proc.port
        for _ in range(2):
            stream = CurlStream(proc.url, chat_body(8, endless=False))
            assert stream.finish() == 0
        assert proc.stop(signal.SIGINT) == 0
    # Clients closed first, so their side holds the TIME_WAIT; the server's port holds none.
    assert time_wait_on(port) == []
    assert plain_bind(port) is None


def test_streams_that_end_in_the_drain_leave_no_time_wait_on_the_port() -> None:
    """Streams in flight at SIGTERM finish during the drain. The server then waits for each
    client (curl closes when the body ends) to close first instead of racing it, so no
    TIME_WAIT is left on the server's port and a plain bind works right after the exit."""
    with server("--parallel", "2", "--ctx-size", "1024") as proc:
        proc.wait_ready()
        port = proc.port
        streams = [CurlStream(proc.url, chat_body(40)) for _ in range(2)]
        for stream in streams:
            assert stream.first_text.wait(GUARD)
        proc.send_signal(signal.SIGTERM)
        for stream in streams:
            assert stream.finish() == 0
            assert stream.payloads()[-1] == "[DONE]"
        assert proc.wait(GUARD) == 0, proc.log
    assert time_wait_on(port) == []
    assert plain_bind(port) is None


def test_time_wait_when_the_server_closed_first_needs_so_reuseaddr() -> None:
    """The contrast to the test above: an idle keep-alive connection is closed by the server at
    drain start, so the server's side keeps a TIME_WAIT; a plain bind then fails, and a new
    server (SO_REUSEADDR) still binds."""
    with server("--parallel", "1", "--ctx-size", "512") as proc:
        proc.wait_ready()
        port = proc.port
        with socket.create_connection(("127.0.0.1", port), timeout=GUARD) as conn:
            assert http_get(conn, "/health")[0] == 200
            assert proc.stop(signal.SIGINT) == 0
            assert conn.recv(1) == b""
    assert time_wait_on(port)
    failure = plain_bind(port)
    assert failure is not None and failure.errno == errno.EADDRINUSE
    with server("--parallel", "1", "--ctx-size", "512", port=port) as again:
        again.wait_ready()
        assert again.stop() == 0


# -- the hypercorn CLI launch -------------------------------------------------------------------


def test_hypercorn_cli_serves_a_stream_and_exits_on_sigterm() -> None:
    port = free_port()
    hypercorn = os.path.join(os.path.dirname(sys.executable), "hypercorn")
    env = {"LLAMA_TRIO_PARALLEL": "1", "LLAMA_TRIO_CTX_SIZE": "512", "LLAMA_TRIO_THREADS": "1"}
    argv = [hypercorn, "--worker-class", "trio", "--bind", f"127.0.0.1:{port}", "server.api.app:create_app()"]
    with ServerProcess(argv=argv, port=port, env=env) as proc:
        proc.wait_ready()
        stream = CurlStream(proc.url, chat_body(8))
        assert stream.finish() == 0
        payloads = stream.payloads()
        assert payloads[-1] == "[DONE]"
        assert sse.finish_reason(payloads[-2]) == "length"
        assert sum(1 for p in payloads if sse.chunk_text(p)) > 0
        assert proc.stop(signal.SIGTERM) == 0, proc.log
