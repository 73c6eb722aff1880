"""What the server's start imports: the modules only some requests need are left for them."""

from __future__ import annotations

import builtins
import pathlib
import subprocess
import sys
import threading

import pytest

from server.api import lazy
from server.api.lazy import deferred, import_deferred
from tests.support.process import ROOT

# Loaded by the first request that needs them, never by the start.
DEFERRED = ("llguidance", "server.engine.gbnf")


def test_the_start_leaves_out_what_only_some_requests_need() -> None:
    # Everything `python -m server` imports before it serves (server/__main__.py's imports).
    script = (
        "import sys, server.__main__, server.serve.lifecycle, server.serve.restart, server.store\n"
        f"print(' '.join(m for m in {DEFERRED!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == []
    # The request models' validators are built by their module's import (which is after the
    # start, in a worker thread), so that no request builds one on the event loop or races it.
    script = (
        "from server.api import schema, model_list\n"
        "print(schema.ChatCompletionRequest.__pydantic_complete__, schema.ChatCompletion.__pydantic_complete__,"
        " model_list.ModelList.__pydantic_complete__)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True"]


# Imported once the server is ready (server.api.lazy), never by the start: pydantic and the
# modules built on it that every client uses (the request models, the model list); the agent
# families' modules only by their first request.
_LATER = (
    "import sys\n"
    "import server.__main__, server.serve.lifecycle, server.serve.restart, server.store\n"
    "from server.api import lazy\n"
    "names = ['pydantic', *lazy.deferred_names()]\n"
    "families = [f'server.api.{f}_{p}' for f in ('anthropic', 'responses') for p in ('parse', 'render', 'stream')]\n"
    "print(*(n in sys.modules for n in names + families))\n"
    "lazy.import_deferred()\n"
    "print(*(n in sys.modules for n in names + families))\n"
    "from server.api import anthropic\n"
    "anthropic.stream.AnthropicStream  # what a Messages stream reads first\n"
    "print(*(n in sys.modules for n in families))\n"
)


def test_the_request_models_are_imported_after_the_start_and_the_families_at_first_use() -> None:
    out = subprocess.run([sys.executable, "-c", _LATER], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after, used = (line.split() for line in out.stdout.splitlines())
    assert before == ["False"] * 9  # pydantic, the schema, the model list, the families' six
    assert after == ["True"] * 3 + ["False"] * 6
    assert used[2:] == ["True", "False", "False", "False"]  # the stream (with what it imports); not the other family


def test_a_deferred_module_is_the_module_itself_at_its_first_read(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lazy, "_DEFERRED", {})  # this test's modules only
    (tmp_path / "deferred_probe.py").write_text("VALUE = 42\n")
    sys.path.insert(0, str(tmp_path))
    try:
        probe = deferred("deferred_probe")
        assert "deferred_probe" not in sys.modules
        assert lazy.deferred_names() == ["deferred_probe"]
        assert probe.VALUE == 42
        assert "deferred_probe" in sys.modules
        with pytest.raises(AttributeError):
            probe.MISSING  # noqa: B018
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("deferred_probe", None)
    with pytest.raises(ModuleNotFoundError):
        deferred("server.api.no_such_family")


def test_a_read_while_another_thread_imports_waits_for_the_whole_module(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lazy, "_DEFERRED", {})  # this test's modules only
    # The warm-up thread imports while a request on the event loop reads: the reader must get
    # the module whole, never one half run (what the standard library's LazyLoader gives on 3.11).
    started = threading.Event()
    (tmp_path / "slow_probe.py").write_text(
        "import time\nFIRST = 1\nimport builtins\nbuiltins._slow_probe_started.set()\ntime.sleep(0.5)\nLAST = 2\n"
    )
    sys.path.insert(0, str(tmp_path))
    builtins._slow_probe_started = started  # type: ignore[attr-defined]
    try:
        probe = deferred("slow_probe")
        importer = threading.Thread(target=import_deferred)
        importer.start()
        assert started.wait(10)
        assert probe.LAST == 2  # waited for the import rather than reading the half-made module
        importer.join(10)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("slow_probe", None)
        del builtins._slow_probe_started  # type: ignore[attr-defined]
