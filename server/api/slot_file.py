"""A saved sequence on disk (``POST /slots/ID?action=save``): our own format, not llama-server's.

    8 bytes  b"LLTRSLOT"
    u32      format version (1)
    u32 + n  the model fingerprint (UTF-8): a file saved with another model or llama.cpp build
             is refused before llama.cpp sees it
    32 bytes the owner: SHA-256 of the saving request's cache scope (its tenant), so that no
             other tenant restores it (and learns its prompt by what it then reuses)
    u32 + 4n the tokens the state holds (int32 each)
    rest     the sequence state (``llama_state_seq_get_data``)

Little-endian. Each cache scope (a tenant, and its ``cache_salt``) keeps its files in a
subfolder of its own of the slot folder, named by a digest of the scope (``folder_name``), so a
file name of one tenant is not another's: a save never meets another's file, and neither a save
nor a restore tells whether one of that name exists. A file saved at the folder's top (versions
before the subfolders) is still restored for its owner, and is nothing to anyone else.

Written to a new file beside the target and renamed over it (a reader never sees half a file);
opened without following links (the subfolder too), so a link in the folder leads nowhere else,
and without blocking, so that a FIFO answers at once; anything but a regular file (a directory,
a FIFO, a device) is neither read nor replaced. Blocking: call these in a worker thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
import struct
from array import array
from collections.abc import Sequence
from typing import BinaryIO

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


def folder_name(scope: str) -> str:
    """The subfolder of the slot folder that holds ``scope``'s files: a digest of the scope
    (never the scope or key itself), so that no tenant's file names are another's."""
    return hashlib.sha256(b"llama-trio slot folder\0" + scope.encode()).hexdigest()[:32]


# What a save must leave free on the slot folder's file system: at least this, and this share
# of it. Clients name their files (and each salt is a folder of its own), so without it they
# could fill the disk that the server, its store and its logs share.
DISK_RESERVE_BYTES = 1 << 30
DISK_RESERVE_SHARE = 0.05


def write(
    folder: str,
    name: str,
    fingerprint: str,
    scope: str,
    tokens: Sequence[int],
    state: bytes | bytearray,
    *,
    reserve: int | None = None,
) -> int:
    """Save as ``name`` in ``scope``'s subfolder of ``folder`` (made when missing; replacing a
    file of the same owner there, ``NotOwner`` for another's, ``SlotFileError`` for an entry that
    is not a regular file); the bytes written. Raises ``StorageError`` when the folder fails, or
    when the file would leave less than ``reserve`` bytes free on its file system (default:
    ``DISK_RESERVE_BYTES`` or ``DISK_RESERVE_SHARE`` of it, the more)."""
    head = encode_head(fingerprint, scope, tokens)
    dir_fd = _open_folder(folder, scope, create=True)
    try:
        disk = os.fstatvfs(dir_fd)
        if reserve is None:
            reserve = max(DISK_RESERVE_BYTES, int(disk.f_blocks * disk.f_frsize * DISK_RESERVE_SHARE))
        free = disk.f_bavail * disk.f_frsize
        if free - len(head) - len(state) < reserve:
            raise StorageError(
                f"cannot be written: it would leave less than {reserve // 2**20} MiB free on the slot folder's disk"
            )
        return _write_in(dir_fd, name, scope, head, state)
    finally:
        os.close(dir_fd)


def _write_in(dir_fd: int, name: str, scope: str, head: bytes, state: bytes | bytearray) -> int:
    _check_owner(name, dir_fd, scope)
    # A short name of its own (never a name the route accepts: those start with no dot), so
    # that a target name of any accepted length has a temporary name within NAME_MAX.
    temp = f".slot-{secrets.token_hex(6)}.tmp"
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        raise StorageError(f"cannot be written ({exc.strerror})") from None
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(head)
            out.write(state)
        os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp, dir_fd=dir_fd)
        if isinstance(exc, IsADirectoryError | NotADirectoryError):  # made there since the check
            raise SlotFileError("cannot be replaced (not a regular file)") from None
        if isinstance(exc, OSError):
            raise StorageError(f"cannot be written ({exc.strerror})") from None
        raise
    return len(head) + len(state)


def _open_folder(folder: str, scope: str, *, create: bool) -> int:
    """A descriptor of ``scope``'s subfolder of ``folder`` (not through a link), made first
    when ``create``. Raises ``FileNotFoundError`` (none yet, not ``create``) or
    ``StorageError``."""
    path = os.path.join(folder, folder_name(scope))
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise StorageError(f"cannot be written ({exc.strerror})") from None
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if create:  # removed since: the folder's trouble
            raise StorageError("cannot be written (its client's folder is gone)") from None
        raise
    except OSError as exc:  # a link or a file where the client's folder should be
        raise StorageError(f"cannot be used (its client's folder: {exc.strerror})") from None


def _open_regular(name: str, dir_fd: int | None = None) -> int:
    """A descriptor for reading ``name`` (in ``dir_fd``): not through a link, never waiting
    (a FIFO), and ``SlotFileError`` unless it is a regular file. Raises ``FileNotFoundError``
    too."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
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


def _read_head(f: BinaryIO) -> bytes:
    """The part of a file that holds its owner (a fingerprint of at most 4 KiB before it)."""
    try:
        return f.read(len(MAGIC) + 8 + 4096 + 32)
    except OSError as exc:
        raise StorageError(f"cannot be read ({exc.strerror})") from None


def _owner_of(head: bytes) -> bytes | None:
    """The owner digest a file's head names, or None when it is not a saved slot's head."""
    if head[: len(MAGIC)] != MAGIC:
        return None
    try:
        (n_mark,) = _U32.unpack_from(head, len(MAGIC) + 4)
    except struct.error:
        return None
    at = len(MAGIC) + 8 + n_mark
    return head[at : at + 32] if len(head) >= at + 32 else None


def _check_owner(name: str, dir_fd: int, scope: str) -> None:
    """``NotOwner`` when ``name`` is a saved slot of another owner (any model);
    ``SlotFileError`` when it is there but not a regular file."""
    try:
        fd = _open_regular(name, dir_fd)
    except FileNotFoundError:
        return
    except SlotFileError as exc:
        raise SlotFileError(f"cannot be replaced: {exc}") from None
    with os.fdopen(fd, "rb") as f:
        owned_by = _owner_of(_read_head(f))
    if owned_by is not None and owned_by != owner(scope):  # not a slot file: replaced
        raise NotOwner("a file of that name belongs to another client")


def read(folder: str, name: str, fingerprint: str, scope: str) -> tuple[list[int], bytes, int]:
    """The tokens and state saved as ``name`` in ``scope``'s subfolder of ``folder`` (or, for
    its owner only, at the folder's top, where versions before the subfolders saved), and the
    file's size. Raises ``FileNotFoundError``, ``SlotFileError`` (a link or anything but a
    regular file, not a slot of this model, or ``NotOwner``) or ``StorageError``."""
    try:
        dir_fd = _open_folder(folder, scope, create=False)
    except FileNotFoundError:
        return _read_top(folder, name, fingerprint, scope)
    try:
        fd = _open_regular(name, dir_fd)
    except FileNotFoundError:
        return _read_top(folder, name, fingerprint, scope)
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "rb") as f:
        raw = _read_rest(f, b"")
    tokens, state = decode(raw, fingerprint, scope)
    return tokens, state, len(raw)


def _read_top(folder: str, name: str, fingerprint: str, scope: str) -> tuple[list[int], bytes, int]:
    """A file saved at the folder's top (one namespace for every client, before the
    subfolders), read for its owner only: anything else of that name there (another's file, one
    that is not a slot, not a regular file) is ``FileNotFoundError``, so that it tells a caller
    nothing, and another's is never read past its head."""
    try:
        fd = _open_regular(os.path.join(folder, name))
    except SlotFileError:
        raise FileNotFoundError(name) from None
    with os.fdopen(fd, "rb") as f:
        head = _read_head(f)
        if _owner_of(head) != owner(scope):
            raise FileNotFoundError(name)
        raw = _read_rest(f, head)
    tokens, state = decode(raw, fingerprint, scope)
    return tokens, state, len(raw)


def _read_rest(f: BinaryIO, head: bytes) -> bytes:
    try:
        return head + f.read()
    except OSError as exc:
        raise StorageError(f"cannot be read ({exc.strerror})") from None
