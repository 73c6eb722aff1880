"""Hot restart: a new copy of this server on our listening socket, handed over to once it says
it is ready.

The old process (on SIGHUP) calls ``start_successor``. It starts ``sys.executable`` with the
command line this process was started with (``sys.orig_argv``) and the current environment,
so a new installation, a replaced model file or changed settings take effect. The listening
socket is passed as a descriptor (``pass_fds``) named by ``LLAMA_TRIO_FD``, and the write end of
a pipe by ``LLAMA_TRIO_READY_FD``. The new process does not accept until its model is loaded
and its engine runs (meanwhile connections go to the old process, or wait in the backlog);
then it writes ``ready <pid>`` on the pipe (``report_ready``) and starts accepting. Only then
does ``start_successor`` return, and the old process stops accepting and drains.

Anything else is a failed restart: the new process exits (a missing or bad model, a crash),
closes the pipe without the word, or is not ready within the bound. It is then killed and
reaped, ``RestartFailed`` says why, and the old process serves on.

The new process is the old one's child, in the same process group (a terminal's Ctrl-C, or
systemd's stop, reaches both). The old one never waits for it once it is ready: when the old
one exits, the new one is reparented (to systemd, or whichever subreaper), never killed.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, MutableMapping

import trio

from server.settings import ENV_PREFIX

logger = logging.getLogger("llama_trio.serve.restart")

# The descriptor of the listening socket (the --fd setting) and of the ready pipe.
FD_VARIABLE = ENV_PREFIX + "FD"
READY_FD_VARIABLE = ENV_PREFIX + "READY_FD"
# A ready word is short; anything longer is not one.
MAX_WORD = 64
# After the new process closed the pipe without the word: how long to wait for its exit status.
EXIT_WAIT = 5.0


class RestartFailed(Exception):
    """The new process did not become ready; the message says why, in one line."""


def successor_command() -> list[str]:
    """This process's own command line, run again: the interpreter and its options (``-m
    server``, or the ``llama-trio`` script) and every argument."""
    return [sys.executable, *sys.orig_argv[1:]]


def successor_env(env: Mapping[str, str], listen_fd: int, ready_fd: int) -> dict[str, str]:
    """``env`` plus the two descriptors' numbers. ``LLAMA_TRIO_FD`` is overridden: a command
    line ``--fd N`` still wins over it, and then names the same socket (ours is descriptor N)."""
    return {**env, FD_VARIABLE: str(listen_fd), READY_FD_VARIABLE: str(ready_fd)}


def take_ready_fd(env: MutableMapping[str, str]) -> int | None:
    """The pipe our predecessor waits on when this process is a hot restart's new copy, else
    None. The variable leaves ``env`` (no child of ours may take it), the descriptor is kept
    from our own children; one that is not open is logged and ignored."""
    raw = env.pop(READY_FD_VARIABLE, None)
    if raw is None:
        return None
    try:
        fd = int(raw)
        os.set_inheritable(fd, False)
    except (ValueError, OSError) as exc:
        logger.warning("%s=%s is not an open descriptor (%s); not reporting readiness", READY_FD_VARIABLE, raw, exc)
        return None
    return fd


def report_ready(fd: int) -> None:
    """Tell our predecessor that we serve: ``ready <pid>`` on the pipe, which is then closed.
    A predecessor that is gone is logged; it does not stop us."""
    try:
        os.write(fd, f"ready {os.getpid()}\n".encode())
    except OSError as exc:
        logger.warning("could not tell the previous process that this one is ready: %s", exc)
    finally:
        os.close(fd)


async def start_successor(
    listen_fd: int,
    ready_within: float,
    *,
    command: list[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> trio.Process:
    """Start a new copy of this server on the listening socket ``listen_fd`` and return it once
    it reports ready, within ``ready_within`` seconds.

    Raises ``RestartFailed`` when it does not; the new process is then killed and reaped.

    *Cancellation*: the new process is killed and reaped, then the cancellation goes on.
    """
    command = command or successor_command()
    read_end, write_end = os.pipe()
    try:
        child_env = successor_env(os.environ if env is None else env, listen_fd, write_end)
        process = await trio.lowlevel.open_process(command, env=child_env, pass_fds=(listen_fd, write_end))
    except OSError as exc:
        os.close(read_end)
        raise RestartFailed(f"could not start {command[0]}: {exc}") from None
    finally:
        os.close(write_end)  # the child's copy is the only one: its exit closes the pipe
    logger.info(
        "hot restart: process %d started process %d; waiting up to %g s for it to be ready",
        os.getpid(),
        process.pid,
        ready_within,
    )
    try:
        with trio.move_on_after(ready_within):
            word = await _read_word(read_end)
            if word == f"ready {process.pid}":
                return process
            raise RestartFailed(f"process {process.pid} {await _why_not_ready(process, word)}")
        raise RestartFailed(f"process {process.pid} was not ready within {ready_within:g} s")
    except BaseException:
        with trio.CancelScope(shield=True):
            await _end(process)
        raise


async def _read_word(fd: int) -> str:
    """What the new process writes on the pipe, up to its newline or its end; owns ``fd``."""
    data = b""
    async with trio.lowlevel.FdStream(fd) as pipe:
        while b"\n" not in data and len(data) < MAX_WORD:
            chunk = await pipe.receive_some(MAX_WORD)
            if not chunk:
                break
            data += chunk
    return data.partition(b"\n")[0].decode("ascii", "replace")


async def _why_not_ready(process: trio.Process, word: str) -> str:
    if word:
        return f"said {word!r} instead of being ready"
    with trio.move_on_after(EXIT_WAIT):
        code = await process.wait()
        if code < 0:
            return f"was killed by signal {-code} before it was ready"
        return f"exited with code {code} before it was ready"
    return "closed its ready pipe without being ready"


async def _end(process: trio.Process) -> None:
    """Kill ``process`` if it still runs, and reap it."""
    if process.returncode is None:
        process.kill()
    await process.wait()
