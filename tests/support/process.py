"""A real server process for tests: ``python -m server`` on a free port, its log captured."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.needs import needs

# The repository root: the server runs from there, as ``python -m server``.
ROOT = pathlib.Path(__file__).resolve().parents[2]
_LISTENING = re.compile(r"listening on http://(\S+):(\d+)")
# A logit_bias that bans SmolLM2's end-of-generation tokens (<|endoftext|>, <|im_end|> and, for
# llama.cpp, <reponame>) and <|im_start|>: an answer runs to max_tokens, whatever is sampled
# (tests/test_ffi.py checks that these are all the model's end tokens).
NO_END_TOKENS = {"0": -100, "1": -100, "2": -100, "4": -100}


class ServerProcess:
    """Starts ``python -m server ARGS --port 0`` (or a given port) and waits for it.

    ``argv`` replaces the whole command, ``cwd`` the directory it runs in (the checkout), ``env``
    adds to the environment. ``wait_ready`` waits for ``/health`` 200. ``log`` is everything the
    process wrote to stderr so far. ``stop`` sends a signal and waits for the exit code.
    """

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        port: int = 0,
        env: dict[str, str] | None = None,
        argv: Sequence[str] | None = None,
        cwd: pathlib.Path = ROOT,
        pass_fds: Sequence[int] = (),
    ) -> None:
        needs("server", "a server process")
        cmd = list(argv) if argv is not None else [sys.executable, "-m", "server", "--port", str(port), *args]
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            pass_fds=pass_fds,
        )
        self._lines: list[str] = []
        self._port: int | None = port or None
        self._port_seen = threading.Event()
        if self._port:
            self._port_seen.set()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.append(line)
            match = _LISTENING.search(line)
            if match and not self._port_seen.is_set():
                self._port = int(match.group(2))
                self._port_seen.set()
        self._port_seen.set()

    @property
    def log(self) -> str:
        return "".join(self._lines)

    @property
    def port(self) -> int:
        if not self._port_seen.wait(60) or self._port is None:
            raise RuntimeError(f"server did not start listening:\n{self.log}")
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 60) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log}")

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        """Samples of /metrics as {"name{label=value,...}": value}."""
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=5).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return out

    def send_signal(self, signum: int = signal.SIGTERM) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 30) -> int:
        return self.proc.wait(timeout)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.send_signal(signum)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)  # stacks into the log, for the failure report
            time.sleep(0.5)
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server did not exit within {timeout} s of signal {signum}:\n{self.log}") from None

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@contextlib.contextmanager
def serving(args: Sequence[str] = (), **kwargs: Any) -> Iterator[ServerProcess]:
    """A ready server for a fixture's lifetime (``ServerProcess``'s keywords pass through); at
    the end it must exit 0 on SIGTERM and have logged no traceback."""
    with ServerProcess(args, **kwargs) as proc:
        proc.wait_ready()
        yield proc
        assert proc.stop() == 0
    assert "Traceback" not in proc.log, proc.log[-5000:]
