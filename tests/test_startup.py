"""What the server's start imports: the modules only some requests need are left for them."""

from __future__ import annotations

import subprocess
import sys

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
