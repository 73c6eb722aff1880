"""Model files for restart tests: a copy of a GGUF that tells itself apart by its general.name,
and a symlink re-pointed at once."""

from __future__ import annotations

import pathlib
import shutil
import struct

# A GGUF string key-value pair: the key (u64 length, bytes), the type (u32, 8 = string), then
# the value (u64 length, bytes); general.name is among the first pairs of the header.
_NAME_KEY = struct.pack("<Q", len(b"general.name")) + b"general.name" + struct.pack("<I", 8)
_HEADER_BYTES = 1 << 20


def renamed_copy(source: pathlib.Path, target: pathlib.Path, prefix: str) -> str:
    """Copy the GGUF ``source`` to ``target`` with another general.name: ``prefix`` padded to
    the old name's length, written over it in place (the ``gguf`` package's rewrite takes
    seconds). Returns the new name."""
    shutil.copyfile(source, target)
    with open(target, "r+b") as gguf:
        header = gguf.read(_HEADER_BYTES)
        at = header.index(_NAME_KEY) + len(_NAME_KEY)
        (length,) = struct.unpack_from("<Q", header, at)
        assert length > len(prefix), f"general.name of {source} is shorter than {prefix!r}"
        name = (prefix + " " + "x" * length)[:length]
        gguf.seek(at + 8)
        gguf.write(name.encode())
    return name


def repoint(link: pathlib.Path, target: pathlib.Path) -> None:
    """Point the symlink ``link`` at ``target`` in one step (a new link renamed over it)."""
    new = link.with_name(link.name + ".new")
    new.symlink_to(target)
    new.replace(link)
