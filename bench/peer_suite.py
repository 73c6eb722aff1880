"""llama.cpp's own server test suite (``tools/server/tests`` in the pinned source) against
llama-server and against our server, with the default model in place of every model the suite
would download; prints a pass/fail table per file for both.

    python -m bench.peer_suite                       # the default files (197 tests)
    python -m bench.peer_suite --quick               # llama.cpp's own routes only (41 tests)
    python -m bench.peer_suite --files test_tokenize.py test_basic.py --sides ours
    python -m bench.peer_suite -k completion         # pytest's -k, passed on

The suite is copied from the unpacked source into a scratch folder at run time (nothing of it is
committed here). Its server launcher is pointed at ``bench/peer_adapter.py``, which maps
llama-server's flags to ours (or, for llama-server, only swaps in the default model). What the
runner adds to the copy is its own: a plugin that skips the suite's model downloads and bounds
each test's time, and stand-ins for two modules the suite imports that we do not install
(``filelock``, ``wget``; neither is used once nothing is downloaded).

Tests that assert a particular model's text (the suite's models are tiny story models; ours is
SmolLM2) fail on both sides alike: the comparison that matters is what llama-server passes and
we do not, listed after the table. A measurement, not part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.common import BUILD_SCRIPT, REPO_ROOT, RESULTS_DIR, llama_tool, markdown_table

SOURCE = REPO_ROOT / "vendor" / "llama.cpp"
SUITE = SOURCE / "tools" / "server" / "tests"
FETCH_SCRIPT = BUILD_SCRIPT.parent / "fetch.sh"
SIDES = ("llama-server", "ours")
# The native API (completion, tokenize, props, slots, infill, templates, metrics) and the OpenAI
# routes: 197 tests, what issue 27 measured.
DEFAULT_FILES = (
    "test_basic.py",
    "test_tokenize.py",
    "test_completion.py",
    "test_chat_completion.py",
    "test_template.py",
    "test_security.py",
    "test_infill.py",
    "test_slot_save.py",
    "test_metrics.py",
    "test_stream.py",
)
# A few minutes a side here: llama.cpp's own routes only (41 tests).
QUICK_FILES = (
    "test_basic.py",
    "test_tokenize.py",
    "test_infill.py",
    "test_slot_save.py",
    "test_metrics.py",
    "test_stream.py",
)
TEST_TIMEOUT = 120  # seconds a test may take (start included) before it counts as failed

_PLUGIN = '''\
"""Added by llama-trio's bench/peer_suite.py: no model downloads, and a time bound per test."""
import os
import signal

import pytest
import utils

utils.ServerPreset.load_all = staticmethod(lambda: None)
TIMEOUT = int(os.environ.get("PEER_TEST_TIMEOUT", "120"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    def on_alarm(signum, frame):
        raise TimeoutError(f"the test ran over {TIMEOUT} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(TIMEOUT)
    try:
        return (yield)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
'''
_FILELOCK = '''\
"""Stand-in (llama-trio's bench/peer_suite.py): one process runs the suite, nothing to lock."""
class FileLock:
    def __init__(self, path):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
'''
_WGET = '''\
"""Stand-in (llama-trio's bench/peer_suite.py): the peer suite downloads nothing."""
def download(url, out=None):
    raise RuntimeError(f"no downloads in the peer suite run: {url}")
'''


@dataclass
class Outcome:
    """One test's result on one side."""

    status: str  # passed, failed, error, skipped
    message: str = ""


@dataclass
class SideResult:
    side: str
    seconds: float
    tests: dict[str, Outcome] = field(default_factory=dict)  # "file::name" -> outcome


def suite_dir() -> pathlib.Path:
    if not SUITE.is_dir():
        env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)}
        subprocess.run([str(FETCH_SCRIPT)], check=True, env=env)
    return SUITE


def prepare_copy(
    scratch: pathlib.Path,
    side: str,
    llama_server: pathlib.Path | None,
    checkout: pathlib.Path,
    threads: int,
    drops: Sequence[str] = (),
) -> pathlib.Path:
    """The suite copied under ``scratch``, with the runner's plugin, stand-ins and launcher (our
    server from ``checkout``)."""
    # The suite's own layout, so that its relative paths (``../../../models/templates``) hold.
    tests = scratch / side / "tools" / "server" / "tests"
    shutil.copytree(suite_dir(), tests, ignore=shutil.ignore_patterns("tmp", "__pycache__", ".pytest_cache"))
    (scratch / side / "models").symlink_to(SOURCE / "models", target_is_directory=True)
    (tests / "tmp").mkdir(exist_ok=True)
    (tests / "peer_plugin.py").write_text(_PLUGIN)
    for module, text in (("filelock", _FILELOCK), ("wget", _WGET)):
        try:
            __import__(module)
        except ImportError:
            (tests / f"{module}.py").write_text(text)
    launcher = tests / "server-adapter"
    extra = f" --llama-server {llama_server}" if llama_server is not None else f' --checkout "{checkout}"'
    extra += f" --threads {threads}" + "".join(f" {flag}" for flag in drops)
    launcher.write_text(
        "#!/bin/sh\n"
        f'cd "{REPO_ROOT}" || exit 1\n'
        f'exec "{sys.executable}" -m bench.peer_adapter --target {side}{extra} -- "$@"\n'
    )
    launcher.chmod(0o755)
    return tests


def run_side(
    side: str, files: list[str], scratch: pathlib.Path, llama_server: pathlib.Path | None, args: argparse.Namespace
) -> SideResult:
    binary = llama_server if side == "llama-server" else None
    drops = [] if side == "llama-server" else [f"--drop-switch={f}" for f in args.drop_switch]
    drops += [] if side == "llama-server" else [f"--drop-value={f}" for f in args.drop_value]
    tests = prepare_copy(scratch, side, binary, args.ours_checkout, args.threads, drops)
    report = tests / "report.xml"
    env = {
        **os.environ,
        "LLAMA_SERVER_BIN_PATH": str(tests / "server-adapter"),
        "PYTHONPATH": str(tests),
        "PORT": str(args.port),
        "PEER_TEST_TIMEOUT": str(args.test_timeout),
    }
    env.pop("PYTEST_ADDOPTS", None)
    command = [sys.executable, "-m", "pytest", "-p", "peer_plugin", "-p", "no:cacheprovider", "-q", "-rN"]
    command += ["--junitxml", str(report), "-o", "junit_family=xunit1"]
    if args.k:
        command += ["-k", args.k]
    command += [f"unit/{name}" for name in files]
    log = scratch / f"{side}.log"
    print(f"peer suite: {side}: {len(files)} files (log: {log})", file=sys.stderr, flush=True)
    started = time.monotonic()
    with log.open("w") as out:
        subprocess.run(command, cwd=tests, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    result = SideResult(side, time.monotonic() - started)
    if report.exists():
        result.tests = read_report(report)
    return result


def read_report(path: pathlib.Path) -> dict[str, Outcome]:
    """Each test's outcome from pytest's JUnit XML, keyed ``file::name``."""
    out: dict[str, Outcome] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("file") or (case.get("classname", "").replace(".", "/") + ".py")
        key = f"{pathlib.Path(file).name}::{case.get('name')}"
        outcome = Outcome("passed")
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                status = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = (element.get("message") or "").strip()
                outcome = Outcome(status, message.splitlines()[0][:200] if message else "")
                break
        out[key] = outcome
    return out


def _passed(tests: dict[str, Outcome], key: str) -> bool:
    outcome = tests.get(key)
    return outcome is not None and outcome.status == "passed"


def summary_rows(files: list[str], results: dict[str, SideResult]) -> list[list[str]]:
    rows = []
    totals = [0, 0, 0, 0]
    for name in files:
        keys = {k for r in results.values() for k in r.tests if k.startswith(name + "::")}
        passed = {side: {k for k in keys if _passed(r.tests, k)} for side, r in results.items()}
        theirs, ours = passed.get("llama-server", set()), passed.get("ours", set())
        gap = len(theirs - ours) if "llama-server" in results and "ours" in results else 0
        row = [len(keys), len(theirs), len(ours), gap]
        totals = [a + b for a, b in zip(totals, row, strict=True)]
        rows.append([name, *map(str, row)])
    rows.append(["all", *map(str, totals)])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="llama.cpp's server test suite against llama-server and ours")
    parser.add_argument("--files", nargs="+", default=list(DEFAULT_FILES), help="files under unit/ to run")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_FILES)}")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("-k", help="pytest's -k expression, passed on")
    parser.add_argument("--port", type=int, default=8391, help="the port the suite's servers listen on")
    parser.add_argument("--test-timeout", type=int, default=TEST_TIMEOUT)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of either server (default 1)")
    parser.add_argument(
        "--ours-checkout",
        type=pathlib.Path,
        default=REPO_ROOT,
        help="the checkout whose server is ours (default: this one; e.g. an older commit's, for a before/after)",
    )
    parser.add_argument(
        "--drop-switch", action="append", default=[], help="a llama-server flag to leave out for ours (older checkouts)"
    )
    parser.add_argument(
        "--drop-value", action="append", default=[], help="a llama-server flag and its value to leave out for ours"
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (logs, copies)")
    parser.add_argument("--no-build", action="store_true", help="do not build llama-server when missing")
    parser.add_argument("--out", default=str(RESULTS_DIR / "peer_suite.json"), help="where the results go (JSON)")
    parser.add_argument(
        "--load",
        nargs="+",
        metavar="JSON",
        help="run nothing: compare the sides of earlier runs' --out files (e.g. each side run on its own)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.files = list(QUICK_FILES)
    if args.load:
        files, loaded = load(args.load)
        report(files, loaded, pathlib.Path(args.out))
        return 0
    llama_server = llama_tool("llama-server", build=not args.no_build) if "llama-server" in args.sides else None
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="peer-suite-"))
    try:
        results = {side: run_side(side, args.files, scratch, llama_server, args) for side in args.sides}
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    report(args.files, results, pathlib.Path(args.out))
    if args.keep:
        print(f"peer suite: logs and copies kept in {scratch}")
    return 0


def load(paths: list[str]) -> tuple[list[str], dict[str, SideResult]]:
    """The files and sides of earlier runs' JSON (a later file's side replaces an earlier's)."""
    files: list[str] = []
    results: dict[str, SideResult] = {}
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        files += [f for f in data["files"] if f not in files]
        for side, entry in data["sides"].items():
            tests = {k: Outcome(**v) for k, v in entry["tests"].items()}
            results[side] = SideResult(side, entry["seconds"], tests)
    return files, results


def report(files: list[str], results: dict[str, SideResult], out: pathlib.Path) -> None:
    """Print the table and what llama-server passes and we do not; write the JSON to ``out``
    and the same text beside it as markdown."""
    header = ["file", "tests", "llama-server passes", "ours passes", "llama-server only"]
    lines = [markdown_table(header, summary_rows(files, results)), ""]
    lines += [f"{side}: {result.seconds:.0f} s" for side, result in results.items()]
    if "llama-server" in results and "ours" in results:
        theirs, ours = results["llama-server"].tests, results["ours"].tests
        gap = sorted(k for k in theirs if _passed(theirs, k) and not _passed(ours, k))
        if gap:
            lines += ["", "llama-server passes, ours does not:", ""]
            for key in gap:
                outcome = ours.get(key, Outcome("missing"))
                lines.append(f"- `{key}`: {outcome.status}: {outcome.message[:300]}")
    text = "\n".join(lines)
    print(text)
    payload = {
        side: {"seconds": round(r.seconds, 1), "tests": {k: vars(o) for k, o in sorted(r.tests.items())}}
        for side, r in results.items()
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"files": files, "sides": payload}, indent=1) + "\n")
    out.with_suffix(".md").write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
