"""What the server's start imports: the modules only some requests need are left for them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from server.api.lazy import lazy_module
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
    # The request models' validators are built at their first use, not at import.
    script = (
        "import server.serve.lifecycle\n"
        "from server.api import schema\n"
        "print(schema.ChatCompletionRequest.__pydantic_complete__, schema.ChatCompletion.__pydantic_complete__)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


# The agent families' models, renderers and streams (pydantic classes and dataclasses, ~12 ms of
# every start otherwise): their routes are registered at start, their modules run at first use.
_FAMILIES = (
    "import sys, types\n"
    "import server.__main__, server.serve.lifecycle\n"
    "names = [f'server.api.{f}_{p}' for f in ('anthropic', 'responses') for p in ('parse', 'render', 'stream')]\n"
    "print(*(type(sys.modules[n]) is types.ModuleType for n in names))\n"
    "sys.modules['server.api.anthropic_stream'].AnthropicStream  # what a Messages stream reads first\n"
    "print(*(type(sys.modules[n]) is types.ModuleType for n in names))\n"
)


def test_the_agent_families_modules_run_at_their_first_use() -> None:
    out = subprocess.run([sys.executable, "-c", _FAMILIES], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after = (line.split() for line in out.stdout.splitlines())
    assert before == ["False"] * 6  # registered lazily, none of them run
    assert after[2:] == ["True", "False", "False", "False"]  # the stream ran; the other family did not


def test_lazy_module_gives_an_imported_module_as_it_is_and_refuses_a_missing_one() -> None:
    assert lazy_module("server.api.errors") is sys.modules["server.api.errors"]
    with pytest.raises(ModuleNotFoundError):
        lazy_module("server.api.no_such_family")
