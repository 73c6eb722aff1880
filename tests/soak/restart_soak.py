"""Restart soak: many restarts under steady load, longer than the tests; counts requests,
restarts and failures.

    .venv/bin/python -m tests.soak.restart_soak --seconds 180 --interval 4 --clients 4
    .venv/bin/python -m tests.soak.restart_soak --mode nginx --seconds 180

``--mode hot`` (the default): one server, restarted with SIGHUP every ``--interval`` seconds.
Its model is a symlink that each restart re-points, between the default model and a copy with
another ``general.name``, and the new process must report the name it was given; every
``--fail-every``-th restart points it at a missing file instead, and the restart must fail while
the old process serves on. ``--mode nginx``: two replicas behind nginx (``deploy/nginx.conf``),
restarted in turn with SIGTERM and started again on their ports.

Clients open a new connection per request and check every answer (``tests/support/load.py``).
Prints one line per restart and a summary; exits 1 when any request failed, any connection was
refused, or any restart went otherwise than planned.

A reliability run, not a ratio benchmark: it lives beside the soak test (pytest does not
collect it) and is built from the tests' own helpers (``tests/support/``).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import signal
import sys
import tempfile
import time

import httpx

from server.model_files import default_model_path
from tests.support.load import Load
from tests.support.models import renamed_copy, repoint
from tests.support.nginx import Nginx
from tests.support.ports import free_port
from tests.support.process import ServerProcess
from tests.support.restarts import alive, hot_restart, restart_in_place, restarts_of, wait_pid
from tests.support.waiting import wait_for

GUARD = 120.0
SERVER = ["--threads", "1", "--parallel", "2", "--ctx-size", "1024", "--drain-timeout", "20"]


def model_name(url: str) -> str:
    (card,) = httpx.get(url + "/v1/models", timeout=GUARD).json()["data"]
    return str(card["meta"]["name"])


def hot_soak(args: argparse.Namespace, directory: pathlib.Path) -> tuple[Load, dict[str, int]]:
    renamed = directory / "renamed.gguf"
    names = {default_model_path(): "", renamed: renamed_copy(default_model_path(), renamed, "llama-trio soak")}
    link = directory / "model.gguf"
    link.symlink_to(default_model_path())
    counts = {"restarts": 0, "failed_as_planned": 0, "unplanned": 0}
    with ServerProcess([*SERVER, "--model", str(link)]) as proc, restarts_of(proc):
        proc.wait_ready()
        names[default_model_path()] = model_name(proc.url)
        pid, first = proc.proc.pid, True
        load = Load(proc.url, clients=args.clients)
        end = time.monotonic() + args.seconds
        try:
            with load:
                n = 0
                while time.monotonic() < end:
                    time.sleep(args.interval)
                    n += 1
                    if n % args.fail_every == 0:
                        _failing_restart(proc, pid, link, directory)
                        counts["failed_as_planned"] += 1
                        print(f"restart {n}: failed as planned; process {pid} serves on ({load.tally})", flush=True)
                        continue
                    target = renamed if n % 2 else default_model_path()
                    repoint(link, target)
                    new = hot_restart(proc, pid, GUARD)
                    code = proc.wait(GUARD) if first else wait_pid(pid, GUARD)
                    name = model_name(proc.url)
                    if code != 0 or name != names[target]:
                        counts["unplanned"] += 1
                        print(f"restart {n}: old exit code {code}, model {name!r}", flush=True)
                    counts["restarts"] += 1
                    print(f"restart {n}: {pid} -> {new}, model {name!r} ({load.tally})", flush=True)
                    pid, first = new, False
        finally:
            if alive(pid):
                os.kill(pid, signal.SIGTERM)
                if not first:
                    wait_pid(pid, GUARD)
            if first:
                proc.wait(GUARD)
        if "Traceback" in proc.log:
            counts["unplanned"] += 1
            print(proc.log[-5000:])
    return load, counts


def _failing_restart(proc: ServerProcess, pid: int, link: pathlib.Path, directory: pathlib.Path) -> None:
    target = link.resolve()
    repoint(link, directory / "missing.gguf")
    seen = len(proc.log)
    os.kill(pid, signal.SIGHUP)
    failed = re.compile(rf"hot restart failed: .*; process {pid} keeps serving")
    wait_for(lambda: failed.search(proc.log[seen:]), "the planned failure", GUARD)
    repoint(link, target)


def nginx_soak(args: argparse.Namespace, directory: pathlib.Path) -> tuple[Load, dict[str, int]]:
    ports = [free_port(), free_port()]
    replicas = [ServerProcess(SERVER, port=port) for port in ports]
    counts = {"restarts": 0, "unplanned": 0}
    try:
        for replica in replicas:
            replica.wait_ready()
        with Nginx(directory, free_port(), ports) as nginx:
            load = Load(nginx.url, clients=args.clients)
            end = time.monotonic() + args.seconds
            with load:
                n = 0
                while time.monotonic() < end:
                    time.sleep(args.interval)
                    i = n % len(replicas)
                    replicas[i] = restart_in_place(replicas[i], SERVER, GUARD)
                    n += 1
                    counts["restarts"] += 1
                    print(f"restart {n}: replica {i} ({load.tally})", flush=True)
        for replica in replicas:
            if "Traceback" in replica.log:
                counts["unplanned"] += 1
            replica.stop()
    finally:
        for replica in replicas:
            replica.__exit__(None, None, None)
    return load, counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["hot", "nginx"], default="hot")
    parser.add_argument("--seconds", type=float, default=180.0, help="how long the load runs")
    parser.add_argument("--interval", type=float, default=4.0, help="seconds between restarts")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--fail-every", type=int, default=5, help="(hot) every n-th restart is made to fail")
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="restart-soak-") as directory:
        soak = hot_soak if args.mode == "hot" else nginx_soak
        load, counts = soak(args, pathlib.Path(directory))
    tally = load.tally
    print(f"\n{args.mode} soak, {time.monotonic() - started:.0f} s, {args.clients} clients: {tally}")
    print(", ".join(f"{key.replace('_', ' ')} {value}" for key, value in counts.items()))
    for failure in tally.failures[:20]:
        print("  ", failure)
    ok = tally.refused == 0 and not tally.failures and counts["unplanned"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
