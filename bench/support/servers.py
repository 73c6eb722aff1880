"""The two servers a benchmark compares, and their processes.

Ours is ``python -m server`` from this checkout; llama-server is llama.cpp's, from the same
pinned build. ``server_command`` gives each side the same shape (sequences, KV cells, threads,
batch, all on the CPU); ``launch`` starts one on a free port with its output in a log file,
prints the log's tail when a measurement fails and stops the process at the end;
``Launched.wait_ready`` times the launch to the first 200 on ``/health``. Also what a benchmark
reads of a process or a build: peak RSS, llama-server's version, the model's end-of-generation
tokens, whether the port binds again.
"""

from __future__ import annotations

import contextlib
import errno
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import trio

from bench import common
from bench.support.client import get_status
from tests.support.ports import free_port, plain_bind

LLAMA_SERVER = "llama-server"
SIDES = ("llama-server", "ours")
BATCH = 512  # n_batch = n_ubatch on both (ours: --batch-size; n_ubatch follows it)

STARTUP_TIMEOUT_S = 120.0
HEALTH_POLL_S = 0.02
STOP_TIMEOUT_S = 60.0  # after SIGTERM, before SIGKILL
LOG_TAIL_CHARS = 3000


def abba(runs_per_side: int) -> Iterator[tuple[int, str]]:
    """(run, side) for ``runs_per_side`` runs of both sides; the side that goes first flips
    every run (llama-server, ours, ours, llama-server, ...), so neither always follows the
    other."""
    for i in range(runs_per_side):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            yield i, side


@dataclass(frozen=True)
class Shape:
    """What both sides get: ``parallel`` sequences, ``ctx`` KV cells in all (one KV stream per
    sequence), ``threads`` for generation and prompts, ``batch`` = n_batch = n_ubatch."""

    parallel: int
    ctx: int
    threads: int
    batch: int = BATCH


def server_command(side: str, exe: pathlib.Path, model_path: pathlib.Path, shape: Shape, port: int) -> list[str]:
    """The command line of ``side`` ("llama-server" or "ours") on 127.0.0.1:``port``.
    llama-server also gets ``--no-webui``; its other defaults stay."""
    if side == LLAMA_SERVER:
        return [
            str(exe),
            "-m", str(model_path),
            "--host", "127.0.0.1",
            "--port", str(port),
            "-np", str(shape.parallel),
            "-c", str(shape.ctx),  # all slots together, as ours
            "--no-kv-unified",  # one KV stream per slot, as ours
            "-t", str(shape.threads),
            "-tb", str(shape.threads),
            "-b", str(shape.batch),
            "-ub", str(shape.batch),
            "-ngl", "0",
            "--no-webui",
        ]  # fmt: skip
    return [
        sys.executable, "-m", "server",
        "--model", str(model_path),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--parallel", str(shape.parallel),
        "--ctx-size", str(shape.ctx),
        "--threads", str(shape.threads),
        "--batch-size", str(shape.batch),
    ]  # fmt: skip


@dataclass
class Launched:
    """One server process on 127.0.0.1:``port``; ``started`` is the ``time.perf_counter()`` of
    its launch."""

    side: str
    port: int
    proc: subprocess.Popen[bytes]
    started: float

    async def wait_ready(self) -> float:
        """Seconds from the launch to the first 200 on ``/health``; raises when the process
        exits first or none comes within ``STARTUP_TIMEOUT_S``."""
        deadline = self.started + STARTUP_TIMEOUT_S
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} while starting")
            if await get_status(self.port, "/health") == 200:
                return time.perf_counter() - self.started
            await trio.sleep(HEALTH_POLL_S)
        raise RuntimeError(f"no 200 on /health within {STARTUP_TIMEOUT_S} s")


@contextlib.contextmanager
def launch(
    side: str, exe: pathlib.Path, model_path: pathlib.Path, shape: Shape, logdir: pathlib.Path
) -> Iterator[Launched]:
    """Start ``side`` on a free port, its output in ``logdir/SIDE-PORT.log``. When the block
    raises, the log's tail goes to stderr; at the end a process still running gets SIGTERM,
    then SIGKILL after ``STOP_TIMEOUT_S``."""
    port = free_port()
    command = server_command(side, exe, model_path, shape, port)
    log_path = logdir / f"{side}-{port}.log"
    with log_path.open("wb") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(
            command, cwd=common.REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            yield Launched(side, port, proc, started)
        except BaseException:
            log.flush()
            tail = log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
            print(f"--- {side} log tail ---\n{tail}", file=sys.stderr)
            raise
        finally:
            stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM a process that still runs, SIGKILL it after ``STOP_TIMEOUT_S``; reap it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def vm_hwm_bytes(pid: int) -> int | None:
    """Peak resident set size of a live process (``VmHWM``)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def plain_bind_outcome(port: int) -> str:
    """ "ok", or the errno name of a bind of 127.0.0.1:port without SO_REUSEADDR (what the
    results record)."""
    failure = plain_bind(port)
    if failure is None:
        return "ok"
    return errno.errorcode.get(failure.errno or 0, str(failure))


def llama_server_version(exe: pathlib.Path) -> str:
    """What ``llama-server --version`` prints, on one line."""
    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    return " ".join((version.stdout + version.stderr).split())


def end_of_generation_tokens(model_path: pathlib.Path) -> list[int]:
    """End-of-generation token ids of the model (banned in every request)."""
    import ffi

    with ffi.Model(model_path) as model:
        vocab = model.vocab
        return sorted(vocab.eog_tokens)
