"""Helpers every benchmark shares: where things are, how llama.cpp's tools get built, how numbers
are summarised and recorded. No measurement happens here."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
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


def llama_pin() -> dict[str, str]:
    """The pinned llama.cpp source (``vendor/llama.cpp.pin``): package, version, sha256."""
    pin: dict[str, str] = {}
    for row in (REPO_ROOT / "vendor" / "llama.cpp.pin").read_text(encoding="utf-8").splitlines():
        key, sep, value = row.partition("=")
        if sep and not row.startswith("#"):
            pin[key.strip().lower()] = value.strip()
    return pin
