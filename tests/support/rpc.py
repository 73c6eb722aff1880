"""llama.cpp's ``ggml-rpc-server`` processes on loopback, built from the pinned source."""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import subprocess
from collections.abc import Iterator

from tests.support.ports import free_port
from tests.support.process import ROOT
from tests.support.waiting import wait_for

RPC_SERVER = "ggml-rpc-server"  # the pinned llama.cpp's target (tools/rpc)


def rpc_server_binary() -> pathlib.Path:
    """The pinned build's ``ggml-rpc-server``, built first when missing (``vendor/build.sh``:
    a no-op when it is there, under a minute on top of the libraries otherwise)."""
    build = ROOT / "vendor" / "build.sh"
    subprocess.run([build, RPC_SERVER], check=True, cwd=ROOT)
    out = subprocess.run([build, "--print-bin-dir"], check=True, capture_output=True, text=True, cwd=ROOT)
    return pathlib.Path(out.stdout.strip()) / RPC_SERVER


def _accepts(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def rpc_servers(count: int, log_dir: pathlib.Path) -> Iterator[list[str]]:
    """``count`` rpc-servers (one CPU thread each) on free loopback ports, for the block; their
    endpoints. Each one's output goes to ``log_dir/rpc-N.log``."""
    binary = rpc_server_binary()
    procs: list[subprocess.Popen[bytes]] = []
    endpoints = []
    try:
        for i in range(count):
            port = free_port()
            with open(log_dir / f"rpc-{i}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [binary, "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, "LLAMA_CACHE": str(log_dir)},
                    )
                )
            wait_for(lambda p=port: _accepts(p) or procs[-1].poll() is not None, f"rpc-server on {port}", 30)
            assert procs[-1].poll() is None, (log_dir / f"rpc-{i}.log").read_text()
            endpoints.append(f"127.0.0.1:{port}")
        yield endpoints
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
