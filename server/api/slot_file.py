"""A saved sequence on disk (``POST /slots/ID?action=save``): our own format, not llama-server's.

    8 bytes  b"LLTRSLOT"
    u32      format version (1)
    u32 + n  the model fingerprint (UTF-8): a file saved with another model or llama.cpp build
             is refused before llama.cpp sees it
    32 bytes the owner: SHA-256 of the saving request's cache scope (its tenant), so that no
             other tenant restores it (and learns its prompt by what it then reuses)
    u32 + 4n the tokens the state holds (int32 each)
    rest     the sequence state (``llama_state_seq_get_data``)

Little-endian. Written to a new file beside the target and renamed over it (a reader never sees
half a file); opened without following links, so a link in the folder leads nowhere else, and
without blocking, so that a FIFO answers at once; anything but a regular file (a directory, a
FIFO, a device) is neither read nor replaced. Blocking: call these in a worker thread.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
import struct
from array import array
from collections.abc import Sequence

MAGIC = b"LLTRSLOT"
VERSION = 1
_U32 = struct.Struct("<I")


class SlotFileError(ValueError):
    """The file is not a saved slot of this model (or not a regular file)."""


class StorageError(Exception):
    """The slot folder failed us (full, not writable...): no fault of the request's."""


def owner(scope: str) -> bytes:
    """Who a file belongs to: a digest of the cache scope (never the scope or key itself)."""
    return hashlib.sha256(b"llama-trio slot owner\0" + scope.encode()).digest()


def encode_head(fingerprint: str, scope: str, tokens: Sequence[int]) -> bytes:
    """Everything before the state."""
    mark = fingerprint.encode()
    ids = array("i", tokens)
    if ids.itemsize != 4:  # pragma: no cover - every platform we build on
        raise RuntimeError("int is not 32 bits here")
    if struct.pack("=I", 1) != _U32.pack(1):
        ids.byteswap()
    head = MAGIC + _U32.pack(VERSION) + _U32.pack(len(mark)) + mark + owner(scope)
    return head + _U32.pack(len(ids)) + ids.tobytes()


class NotOwner(SlotFileError):
    """The file belongs to another tenant."""


def decode(raw: bytes, fingerprint: str, scope: str) -> tuple[list[int], bytes]:
    """The tokens and state of a file's bytes, checked against this model's ``fingerprint``
    and the reader's ``scope`` (``NotOwner``)."""
    at = len(MAGIC)
    if raw[:at] != MAGIC:
        raise SlotFileError("not a saved slot of this server")
    try:
        (version,) = _U32.unpack_from(raw, at)
        (n_mark,) = _U32.unpack_from(raw, at + 4)
        mark = raw[at + 8 : at + 8 + n_mark]
        at += 8 + n_mark
        owned_by = raw[at : at + 32]
        (n_tokens,) = _U32.unpack_from(raw, at + 32)
        at += 36
    except struct.error:
        raise SlotFileError("cut short") from None
    if version != VERSION:
        raise SlotFileError(f"format version {version}, not {VERSION}")
    if mark != fingerprint.encode():
        raise SlotFileError("saved with another model or llama.cpp build")
    if owned_by != owner(scope):
        raise NotOwner("saved by another client")
    end = at + 4 * n_tokens
    if end > len(raw):
        raise SlotFileError("cut short")
    ids = array("i")
    ids.frombytes(raw[at:end])
    if struct.pack("=I", 1) != _U32.pack(1):
        ids.byteswap()
    return ids.tolist(), raw[end:]


def write(path: str, fingerprint: str, scope: str, tokens: Sequence[int], state: bytes | bytearray) -> int:
    """Save to ``path`` (replacing a file of the same owner; ``NotOwner`` for another's,
    ``SlotFileError`` for an entry that is not a regular file); the bytes written. Raises
    ``StorageError`` when the folder fails."""
    head = encode_head(fingerprint, scope, tokens)
    _check_owner(path, scope)
    # A short name of its own (never a name the route accepts: those start with no dot), so
    # that a target name of any accepted length has a temporary name within NAME_MAX.
    temp = os.path.join(os.path.dirname(path), f".slot-{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise StorageError(f"cannot be written ({exc.strerror})") from None
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(head)
            out.write(state)
        os.replace(temp, path)
    except BaseException as exc:
        if os.path.lexists(temp):
            os.unlink(temp)
        if isinstance(exc, IsADirectoryError | NotADirectoryError):  # made there since the check
            raise SlotFileError("cannot be replaced (not a regular file)") from None
        if isinstance(exc, OSError):
            raise StorageError(f"cannot be written ({exc.strerror})") from None
        raise
    return len(head) + len(state)


def _open_regular(path: str) -> int:
    """A descriptor for reading ``path``: not through a link, never waiting (a FIFO), and
    ``SlotFileError`` unless it is a regular file. Raises ``FileNotFoundError`` too."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise SlotFileError(f"cannot be opened ({exc.strerror})") from None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        regular = False
    if not regular:
        os.close(fd)
        raise SlotFileError("not a regular file")
    return fd


def _check_owner(path: str, scope: str) -> None:
    """``NotOwner`` when ``path`` is a saved slot of another owner (any model);
    ``SlotFileError`` when it is there but not a regular file."""
    try:
        fd = _open_regular(path)
    except FileNotFoundError:
        return
    except SlotFileError as exc:
        raise SlotFileError(f"cannot be replaced: {exc}") from None
    with os.fdopen(fd, "rb") as f:
        try:
            head = f.read(len(MAGIC) + 8 + 4096 + 32)
        except OSError as exc:
            raise StorageError(f"cannot be read ({exc.strerror})") from None
    if head[: len(MAGIC)] != MAGIC:
        return  # not a slot file: replaced
    try:
        (n_mark,) = _U32.unpack_from(head, len(MAGIC) + 4)
    except struct.error:
        return
    at = len(MAGIC) + 8 + n_mark
    if len(head) >= at + 32 and head[at : at + 32] != owner(scope):
        raise NotOwner("a file of that name belongs to another client")


def read(path: str, fingerprint: str, scope: str) -> tuple[list[int], bytes, int]:
    """The tokens and state saved at ``path``, and the file's size. Raises
    ``FileNotFoundError``, ``SlotFileError`` (a link or anything but a regular file, not a slot
    of this model, or ``NotOwner``) or ``StorageError``."""
    fd = _open_regular(path)
    with os.fdopen(fd, "rb") as f:
        try:
            raw = f.read()
        except OSError as exc:
            raise StorageError(f"cannot be read ({exc.strerror})") from None
    tokens, state = decode(raw, fingerprint, scope)
    return tokens, state, len(raw)
