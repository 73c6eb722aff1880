"""Helpers every benchmark shares: where things are, how llama.cpp's tools get built, how numbers
are summarised and recorded. No measurement happens here."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO_ROOT / "vendor" / "build.sh"
RESULTS_DIR = REPO_ROOT / "bench" / "results"


def model_path(path: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """``path`` when given, else the default model (raises, with the fix, when it is missing)."""
    if path is not None:
        return pathlib.Path(path)
    from server.model_files import default_model_path

    return default_model_path()


def parser(
    description: str,
    *,
    tool: str,
    runs_default: int,
    runs_help: str,
    retries_default: int | None = None,
    retries_help: str = "most repeats of one measurement",
    max_foreign_help: str | None = None,
    max_foreign_default: float = 0.25,
) -> argparse.ArgumentParser:
    """The command line every benchmark shares; a benchmark adds only its own options.

    Always: ``--runs`` (``runs_help``, then the default in parentheses), ``--model``,
    ``--threads`` (default 2) and ``--no-build`` (do not build llama.cpp's ``tool``). With
    ``retries_default``: ``--retries``; with ``max_foreign_help``: ``--max-foreign``. Range
    checks stay with each benchmark (``parser.error``).
    """
    out = argparse.ArgumentParser(description=description)
    out.add_argument("--runs", type=int, default=runs_default, help=f"{runs_help} (default {runs_default})")
    out.add_argument("--model", help="GGUF file (default: the bundled default model)")
    out.add_argument("--threads", type=int, default=2)
    if max_foreign_help is not None:
        out.add_argument(
            "--max-foreign",
            type=float,
            default=max_foreign_default,
            help=f"{max_foreign_help} (default {max_foreign_default})",
        )
    if retries_default is not None:
        out.add_argument(
            "--retries", type=int, default=retries_default, help=f"{retries_help} (default {retries_default})"
        )
    out.add_argument("--no-build", action="store_true", help=f"do not build {tool} when missing")
    return out


def _build_env() -> dict[str, str]:
    # vendor/fetch.sh runs "$PYTHON -m pip download" on a fresh machine: use this interpreter.
    return {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)}


def llama_bin_dir() -> pathlib.Path:
    """Where ``vendor/build.sh TARGET`` leaves llama.cpp's tool binaries (nothing is built)."""
    out = subprocess.run(
        [str(BUILD_SCRIPT), "--print-bin-dir"], check=True, capture_output=True, text=True, env=_build_env()
    )
    return pathlib.Path(out.stdout.strip())


def llama_tool(name: str, *, build: bool = True) -> pathlib.Path:
    """Path of llama.cpp tool ``name`` (e.g. ``llama-batched-bench``) from the pinned source.

    With ``build`` it is built first when missing (``vendor/build.sh`` returns at once when it is
    already there; ``JOBS`` in the environment caps the parallel jobs). Raises
    ``FileNotFoundError`` when the binary is still not there.
    """
    if build:
        subprocess.run([str(BUILD_SCRIPT), name], check=True, env=_build_env())
    path = llama_bin_dir() / name
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"{path} is missing; build it with: vendor/build.sh {name}")
    return path


@dataclass(frozen=True)
class Summary:
    """Median, min and max of a few repeated measurements."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        if not values:
            raise ValueError("no values to summarise")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def format(self, digits: int = 1) -> str:
        """``"106.2 (104.0-108.9)"``: the median, then the range."""
        return f"{self.median:.{digits}f} ({self.low:.{digits}f}-{self.high:.{digits}f})"

    def as_dict(self) -> dict[str, float | int]:
        return {"median": self.median, "min": self.low, "max": self.high, "n": self.n}


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table, columns padded to line up in a terminal."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or what ``platform`` knows elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for row in f:
                key, _, value = row.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> tuple[float, float, float] | None:
    """1, 5 and 15 minute load averages (other work on a shared machine skews timings)."""
    try:
        return os.getloadavg()
    except OSError:
        return None


def _busy_seconds() -> float | None:
    """CPU seconds all cores have spent busy since boot (``/proc/stat``), or None elsewhere."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal (guest time is already inside user)
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a live process (``/proc/PID/stat``), in seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        stat = f.read()
    # The command name may hold spaces and parentheses; the fields after the last ")" do not.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class CpuWatch:
    """How busy the machine was with *other* work while something was measured.

    ``CpuWatch(pids)`` starts watching; ``foreign_cores()`` is the average number of cores
    that processes other than this one, its waited-for children and ``pids`` kept busy since
    then. On a shared machine a run with a high value competed for the cores and is suspect.
    None where ``/proc`` is missing.
    """

    def __init__(self, pids: Sequence[int] = ()) -> None:
        self._pids = list(pids)
        self._wall = time.monotonic()
        self._busy = _busy_seconds()
        self._own = _own_cpu_seconds() + self._pid_seconds()

    def _pid_seconds(self) -> float:
        total = 0.0
        for pid in self._pids:
            try:
                total += process_cpu_seconds(pid)
            except (OSError, ValueError):
                pass
        return total

    def foreign_cores(self) -> float | None:
        busy = _busy_seconds()
        if busy is None or self._busy is None:
            return None
        wall = time.monotonic() - self._wall
        own = _own_cpu_seconds() + self._pid_seconds() - self._own
        return max(0.0, (busy - self._busy - own) / wall) if wall > 0 else None


def wait_for_quiet(
    max_foreign: float, *, quiet_s: float = 2.0, probe_s: float = 0.5, give_up_s: float = 300.0
) -> float:
    """Block until other processes have kept at most ``max_foreign`` cores busy for ``quiet_s``
    in a row (probed every ``probe_s``; at most ``give_up_s``); returns the seconds waited.
    On 2 cores llama.cpp's threads wait for each other at every graph node, so one busy
    neighbour slows a decode many times over; a measurement taken then says nothing."""
    start = time.monotonic()
    quiet_since = start
    while time.monotonic() - start < give_up_s:
        watch = CpuWatch()
        time.sleep(probe_s)
        if (watch.foreign_cores() or 0.0) > max_foreign:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            break
    return time.monotonic() - start


def machine_info() -> dict[str, Any]:
    """What a reader needs to compare results across machines."""
    return {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "machine": platform.machine(),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "load_average": load_average(),
    }


def write_results(name: str, data: dict[str, Any]) -> pathlib.Path:
    """Write ``data`` as ``bench/results/NAME.json`` (pretty, stable key order); returns the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def jsonl_records(output: str, key: str) -> list[dict[str, Any]]:
    """The JSON objects among ``output``'s lines that have ``key`` (llama.cpp tools mix log
    lines with their ``--output-format jsonl`` records)."""
    records: list[dict[str, Any]] = []
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{") and f'"{key}"' in line:
            records.append(json.loads(line))
    return records


# What a benchmark measures of ours: uncommitted changes here make its commit id misleading.
MEASURED_PATHS = ("server", "ffi", "build_ffi.py", "vendor")


def git_version() -> dict[str, Any]:
    """This checkout's commit, and whether the code a benchmark measures (``MEASURED_PATHS``)
    differs from it (changes to the benchmarks themselves do not count)."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, check=True, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", *MEASURED_PATHS],
            cwd=REPO_ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(dirty)}


def llama_pin() -> dict[str, str]:
    """The pinned llama.cpp source (``vendor/llama.cpp.pin``): package, version, sha256."""
    pin: dict[str, str] = {}
    for row in (REPO_ROOT / "vendor" / "llama.cpp.pin").read_text(encoding="utf-8").splitlines():
        key, sep, value = row.partition("=")
        if sep and not row.startswith("#"):
            pin[key.strip().lower()] = value.strip()
    return pin
