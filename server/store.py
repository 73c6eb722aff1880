"""``ResponseStore``: the responses ``/v1/responses`` keeps (``store``), in SQLite.

One connection, owned by one ``ResponseStore`` with an idempotent ``close()``, open while the
server serves (``ServerState.run_store``); every call runs in a worker thread
(``trio.to_thread``), one at a time. In memory by default; with a file
(``--responses-db``) stored responses outlive the process, and a hot restart's two processes
use the file together: WAL journal (a reader never waits for the writer) and a busy timeout
for the moment both write.

Every row belongs to a tenant (the hash of an API key; "" without keys); reading and deleting
stay within the tenant, so another key's id reads as absent, never as someone's. Bounded per
tenant: each write is followed, in the same transaction, by dropping the writer's own oldest
responses until its total is within ``max_bytes`` (a response larger than that on its own is
not kept, and takes nothing with it), so that one tenant's writes never push out another's.
Each tenant's total is kept by triggers in the database itself, so two processes share one
count. (A file written before the bound was per tenant also has a global ``kept`` count, whose
triggers a process of that version still uses during a hot restart; it is left alone.)

A response being made (``begin``, until ``put`` or ``end``) can be deleted already: the delete
is remembered, and ``put`` then keeps nothing. This is the process's own memory: during a hot
restart, the other process answers such a delete with a 404.

A stored response is its object (what ``GET /v1/responses/{id}`` answers) and its context:
every input item the model saw (a continued response's history included), so that continuing
it needs no other row, whatever the bound has dropped since.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

logger = logging.getLogger("llama_trio.store")

MIB = 1024 * 1024
# How long a write waits for the other process's write (a hot restart) before failing.
BUSY_TIMEOUT_S = 5.0

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- the order of writing: the oldest go first
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    response TEXT NOT NULL,
    context TEXT NOT NULL,
    size INTEGER NOT NULL,
    UNIQUE (tenant, id)
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (tenant, seq);
"""
# Each tenant's bytes, made once (from the rows already there: a file from before) and then kept
# by triggers.
_TENANT_BYTES = (
    "CREATE TABLE tenant_bytes (tenant TEXT PRIMARY KEY, bytes INTEGER NOT NULL)",
    "INSERT INTO tenant_bytes SELECT tenant, SUM(size) FROM responses GROUP BY tenant",
    """CREATE TRIGGER tenant_bytes_added AFTER INSERT ON responses BEGIN
        INSERT INTO tenant_bytes VALUES (new.tenant, new.size)
            ON CONFLICT (tenant) DO UPDATE SET bytes = bytes + new.size;
    END""",
    """CREATE TRIGGER tenant_bytes_removed AFTER DELETE ON responses BEGIN
        UPDATE tenant_bytes SET bytes = bytes - old.size WHERE tenant = old.tenant;
    END""",
)


class StoreError(OSError):
    """The store cannot be opened (the message names the file) or is closed."""

    def __str__(self) -> str:
        return str(self.strerror)


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]
    context: list[dict[str, Any]]


class ResponseStore:
    """Stored responses in SQLite at ``path`` (None: in memory), at most ``max_bytes`` of them,
    once ``open``; until then, and after ``close``, every call raises ``StoreError``."""

    def __init__(self, path: str | None, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._lock = trio.Lock()  # one call at a time on the connection
        self._closing = threading.Lock()
        self._db: sqlite3.Connection | None = None
        # (tenant, id) of the responses being made: True once deleted.
        self._pending: dict[tuple[str, str], bool] = {}

    @classmethod
    def check(cls, path: str) -> None:
        """Open the file and close it again: a ``StoreError`` now, when it cannot be used,
        rather than once the server runs. Blocking: call it before the event loop runs."""
        store = cls(path, 0)
        store.open()
        store.close()

    def open(self) -> None:
        """Connect and make the tables (once). Blocking: call it in a worker thread, or before
        the event loop runs."""
        try:
            db = sqlite3.connect(
                self.path or ":memory:", timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise StoreError(0, f"cannot open the responses store {self.path}: {exc}") from None
        try:
            if self.path is not None:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            _make_tenant_bytes(db)
        except sqlite3.Error as exc:
            db.close()
            raise StoreError(0, f"cannot open the responses store {self.path}: {exc}") from None
        with self._closing:
            assert self._db is None, "opened twice"
            self._db = db

    def close(self) -> None:
        """Close the connection (idempotent); later calls raise ``StoreError``."""
        with self._closing:
            db, self._db = self._db, None
        if db is not None:
            db.close()

    async def aclose(self) -> None:
        """``close`` once no call is running, in a worker thread.

        *Cancellation*: shielded; the close is never abandoned."""
        with trio.CancelScope(shield=True):
            async with self._lock:
                await trio.to_thread.run_sync(self.close)

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn(connection)`` in a worker thread, one call at a time.

        *Cancellation*: a call in a worker thread is waited for, never abandoned."""
        async with self._lock:
            db = self._db
            if db is None:
                raise StoreError(0, "the responses store is not open")
            try:
                return await trio.to_thread.run_sync(fn, db)
            except sqlite3.Error as exc:  # locked past the busy timeout, disk full, corrupt, I/O
                logger.warning("responses store: %s", exc)
                raise StoreError(0, f"the responses store failed: {exc}") from None

    def begin(self, tenant: str, id_: str) -> None:
        """``tenant``'s response ``id_`` is being made: a delete before its ``put`` is kept."""
        self._pending[(tenant, id_)] = False

    def end(self, tenant: str, id_: str) -> None:
        """The response begun is done, kept or not (idempotent)."""
        self._pending.pop((tenant, id_), None)

    async def put(self, tenant: str, id_: str, response: dict[str, Any], context: list[dict[str, Any]]) -> bool:
        """Keep a response (its object and its context) for ``tenant``; the tenant's oldest
        responses go until it is within its bound. False: it is larger than the bound on its
        own, or was deleted while being made, and is not kept (nothing else goes)."""
        key = (tenant, id_)
        if self._pending.get(key):
            self.end(tenant, id_)
            return False

        def put(db: sqlite3.Connection) -> bool:
            response_text = json.dumps(response, ensure_ascii=False)
            context_text = json.dumps(context, ensure_ascii=False)
            size = len(response_text.encode()) + len(context_text.encode())
            if size > self.max_bytes:
                logger.warning("response %s not stored: %d bytes, more than --responses-max-mb", id_, size)
                return False
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute(
                    "INSERT INTO responses (tenant, id, response, context, size) VALUES (?, ?, ?, ?, ?)",
                    (tenant, id_, response_text, context_text, size),
                )
                dropped = _trim(db, tenant, self.max_bytes)
                db.execute("COMMIT")
            except BaseException:
                _roll_back(db)
                raise
            if dropped:
                logger.debug(
                    "responses store: %d oldest of a tenant dropped to stay within %d bytes", dropped, self.max_bytes
                )
            return True

        kept = await self._run(put)
        if self._pending.pop(key, False) and kept:  # deleted while it was being written
            await self.delete(tenant, id_)
            return False
        return kept

    async def get(self, tenant: str, id_: str) -> Stored | None:
        """``tenant``'s response ``id_``, or None (never stored, dropped, deleted, or another's)."""

        def get(db: sqlite3.Connection) -> Stored | None:
            row = db.execute(
                "SELECT response, context FROM responses WHERE tenant = ? AND id = ?", (tenant, id_)
            ).fetchone()
            return None if row is None else Stored(json.loads(row[0]), json.loads(row[1]))

        return await self._run(get)

    async def delete(self, tenant: str, id_: str) -> bool:
        """Forget ``tenant``'s response ``id_``, kept or being made; whether there was one."""
        key = (tenant, id_)
        pending = key in self._pending
        if pending:
            self._pending[key] = True

        def delete(db: sqlite3.Connection) -> bool:
            return db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, id_)).rowcount > 0

        return await self._run(delete) or pending

    async def usage(self) -> tuple[int, int]:
        """(responses kept, their bytes)."""

        def usage(db: sqlite3.Connection) -> tuple[int, int]:
            count = db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]
            return int(count), int(db.execute("SELECT TOTAL(bytes) FROM tenant_bytes").fetchone()[0])

        return await self._run(usage)


def _make_tenant_bytes(db: sqlite3.Connection) -> None:
    """Each tenant's total and its triggers, once per file (a hot restart's two processes may
    both open it: the first makes them, in one transaction)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        made = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'tenant_bytes'").fetchone()
        if made is None:
            for statement in _TENANT_BYTES:
                db.execute(statement)
        db.execute("COMMIT")
    except BaseException:
        _roll_back(db)
        raise


def _roll_back(db: sqlite3.Connection) -> None:
    """End the transaction a failed statement left, if SQLite has not ended it itself (a full
    disk does): a ROLLBACK then would raise in place of the error that explains."""
    if db.in_transaction:
        db.execute("ROLLBACK")


def _trim(db: sqlite3.Connection, tenant: str, max_bytes: int) -> int:
    """Drop ``tenant``'s oldest rows until its total is within ``max_bytes``; how many went."""
    dropped = 0
    row = db.execute("SELECT bytes FROM tenant_bytes WHERE tenant = ?", (tenant,)).fetchone()
    total = 0 if row is None else row[0]
    while total > max_bytes:
        row = db.execute("SELECT seq, size FROM responses WHERE tenant = ? ORDER BY seq LIMIT 1", (tenant,)).fetchone()
        if row is None:
            break
        db.execute("DELETE FROM responses WHERE seq = ?", (row[0],))
        total -= row[1]
        dropped += 1
    return dropped
