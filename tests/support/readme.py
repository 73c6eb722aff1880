"""The README's examples, run as written: the fenced ``sh`` and ``python`` blocks of one section,
against a test server in place of ``http://127.0.0.1:8080``."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
README_URL = "http://127.0.0.1:8080"
_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def examples(heading: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block in the section under ``heading`` (a whole line,
    e.g. ``### Responses API``), up to the next heading of its level or above."""
    text = README.read_text()
    start = text.index("\n" + heading + "\n")
    level = heading.split(" ")[0]
    ends = [m.start() for m in re.finditer(f"^#{{1,{len(level)}}} ", text[start + 1 :], re.MULTILINE)]
    section = text[start + 1 : start + 1 + (ends[1] if len(ends) > 1 else len(text))]
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(section)]


def run_examples(heading: str, url: str, timeout: float = 300) -> list[str]:
    """Run the section's ``sh`` and ``python`` blocks against ``url``; each must exit 0. Their
    outputs, in order."""
    outputs = []
    for language, code in examples(heading):
        code = code.replace(README_URL, url)
        if language == "sh":
            argv = ["bash", "-euo", "pipefail", "-c", code]
        elif language == "python":
            argv = [sys.executable, "-c", code]
        else:
            continue
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        assert done.returncode == 0, f"{language} example failed:\n{code}\n{done.stdout}\n{done.stderr}"
        outputs.append(done.stdout)
    return outputs
