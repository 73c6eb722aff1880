"""README's Settings table says what ``server.settings`` does: one row per flag, same variable, same
meaning as the ``--help`` text."""

from __future__ import annotations

import pathlib
import re
from dataclasses import fields

from server.settings import _HELP, ENV_PREFIX, Settings

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
_ROW = re.compile(r"^\| `--([a-z-]+)` \| `([A-Z_]+)` \| [^|]+ \| (.+) \|$")


def test_settings_table_matches_the_flags() -> None:
    rows = {}
    for line in README.read_text().splitlines():
        match = _ROW.match(line)
        if match:
            flag, variable, meaning = match.groups()
            assert flag not in rows, f"--{flag} has two rows"
            rows[flag] = (variable, meaning)
    names = [f.name for f in fields(Settings)]
    assert sorted(rows) == sorted(name.replace("_", "-") for name in names)
    for name in names:
        variable, meaning = rows[name.replace("_", "-")]
        assert variable == ENV_PREFIX + name.upper()
        assert meaning == _HELP[name], f"--{name}: README says {meaning!r}, --help says {_HELP[name]!r}"
