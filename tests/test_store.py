"""``server/store.py`` without a server: the responses store's tenants, bound, file sharing (as a
hot restart's two processes share it) and close."""

from __future__ import annotations

import pathlib
import sqlite3

import pytest
import trio
import trio.lowlevel

from server.store import ResponseStore, StoreError


def opened(path: str | None, max_bytes: int) -> ResponseStore:
    store = ResponseStore(path, max_bytes)
    store.open()
    return store


def response(id_: str, text: str) -> dict:
    return {"id": id_, "object": "response", "output": [{"type": "message", "content": [{"text": text}]}]}


async def test_tenants_read_and_delete_only_their_own() -> None:
    store = opened(None, 1 << 20)
    try:
        await store.put("a", "resp_1", response("resp_1", "hello"), [{"type": "message", "id": "msg_1"}])
        got = await store.get("a", "resp_1")
        assert got is not None and got.response == response("resp_1", "hello")
        assert got.context == [{"type": "message", "id": "msg_1"}]
        assert await store.get("b", "resp_1") is None  # another tenant's id reads as absent
        assert not await store.delete("b", "resp_1")
        assert await store.get("a", "resp_1") is not None
        assert await store.delete("a", "resp_1")
        assert not await store.delete("a", "resp_1")
        assert await store.get("a", "resp_1") is None
        assert await store.usage() == (0, 0)
    finally:
        store.close()


async def test_bound_drops_the_oldest_first() -> None:
    bound = 4000
    store = opened(None, bound)
    try:
        for i in range(20):
            await store.put("t", f"resp_{i}", response(f"resp_{i}", "x" * 300), [])
            count, size = await store.usage()
            assert size <= bound
        kept = [i for i in range(20) if await store.get("t", f"resp_{i}") is not None]
        assert kept == list(range(20 - count, 20)) and 5 <= count < 20  # the newest, in a row
        # One response larger than the whole bound is not kept, and takes nothing with it.
        await store.put("t", "huge", response("huge", "y" * bound), [])
        assert await store.get("t", "huge") is None
        assert (await store.usage())[0] == count
    finally:
        store.close()


async def test_two_stores_share_a_file(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "responses.db")
    old = opened(path, 1 << 20)
    new = opened(path, 1 << 20)  # as a hot restart's new process opens it
    try:
        await old.put("t", "resp_old", response("resp_old", "before"), [])
        got = await new.get("t", "resp_old")
        assert got is not None and got.response["id"] == "resp_old"

        async def writes(store: ResponseStore, name: str) -> None:
            for i in range(20):
                await store.put("t", f"{name}_{i}", response(name, str(i)), [])

        async with trio.open_nursery() as nursery:  # both write at once: the busy timeout waits
            nursery.start_soon(writes, old, "a")
            nursery.start_soon(writes, new, "b")
        assert (await old.usage())[0] == 41 == (await new.usage())[0]
    finally:
        old.close()
        new.close()
    reopened = opened(path, 1 << 20)  # and a later process finds them all
    try:
        assert (await reopened.get("t", "b_19")) is not None
    finally:
        reopened.close()


async def test_not_open_then_closed_idempotently() -> None:
    store = ResponseStore(None, 1 << 20)
    with pytest.raises(StoreError, match="not open"):
        await store.get("t", "resp_1")
    store.open()
    assert await store.get("t", "resp_1") is None
    await store.aclose()
    store.close()
    with pytest.raises(StoreError):
        await store.get("t", "resp_1")


def test_a_file_that_cannot_be_opened_is_one_clear_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(StoreError, match="cannot open the responses store"):
        ResponseStore.check(str(tmp_path / "missing" / "responses.db"))
    (tmp_path / "text").write_text("not a database, " * 100)
    with pytest.raises(StoreError, match="cannot open the responses store"):
        ResponseStore.check(str(tmp_path / "text"))


async def test_the_bound_is_per_tenant_one_tenant_never_pushes_out_another() -> None:
    bound = 4000
    store = opened(None, bound)
    try:
        await store.put("a", "resp_a", response("resp_a", "mine"), [])
        for i in range(40):  # ten times the bound, by another tenant
            await store.put("b", f"resp_b{i}", response(f"resp_b{i}", "x" * 300), [])
        assert await store.get("a", "resp_a") is not None
        kept_b = [i for i in range(40) if await store.get("b", f"resp_b{i}") is not None]
        assert kept_b == list(range(40 - len(kept_b), 40)) and 5 <= len(kept_b) < 40  # b's newest
        count, size = await store.usage()
        assert count == len(kept_b) + 1 and size <= 2 * bound
    finally:
        store.close()


async def test_a_file_from_before_gets_each_tenants_total(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)  # the schema before the per-tenant bound, with rows in it
    db.executescript(
        "CREATE TABLE responses (seq INTEGER PRIMARY KEY AUTOINCREMENT, tenant TEXT NOT NULL, id TEXT NOT NULL,"
        " response TEXT NOT NULL, context TEXT NOT NULL, size INTEGER NOT NULL, UNIQUE (tenant, id));"
        "CREATE TABLE kept (one INTEGER PRIMARY KEY CHECK (one = 1), bytes INTEGER NOT NULL);"
        "INSERT INTO kept VALUES (1, 0);"
        "CREATE TRIGGER responses_added AFTER INSERT ON responses BEGIN UPDATE kept SET bytes = bytes + new.size; END;"
        "INSERT INTO responses (tenant, id, response, context, size) VALUES ('a', 'r1', '{}', '[]', 1500);"
        "INSERT INTO responses (tenant, id, response, context, size) VALUES ('a', 'r2', '{}', '[]', 1500);"
        "INSERT INTO responses (tenant, id, response, context, size) VALUES ('b', 'r3', '{}', '[]', 1500);"
    )
    db.commit()
    db.close()
    store = opened(str(path), 4000)
    try:
        assert await store.usage() == (3, 4500)
        await store.put("a", "r4", response("r4", "x" * 1200), [])  # over a's 4000: its oldest goes
        assert await store.get("a", "r1") is None
        assert await store.get("a", "r2") is not None and await store.get("b", "r3") is not None
    finally:
        store.close()


async def test_a_response_deleted_while_being_made_is_not_kept() -> None:
    store = opened(None, 1 << 20)
    try:
        store.begin("a", "resp_1")
        assert not await store.delete("b", "resp_1")  # another tenant's: absent
        assert await store.delete("a", "resp_1")  # it exists, being made: the delete is kept
        assert not await store.put("a", "resp_1", response("resp_1", "late"), [])
        assert await store.get("a", "resp_1") is None
        store.end("a", "resp_1")  # idempotent
        # Deleted while its write runs: the write completes, then the row goes.
        store.begin("a", "resp_2")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.put, "a", "resp_2", response("resp_2", "x"), [])
            await trio.lowlevel.checkpoint()
            assert await store.delete("a", "resp_2")
        assert await store.get("a", "resp_2") is None
        # One not deleted is kept as always, and its entry is gone.
        store.begin("a", "resp_3")
        assert await store.put("a", "resp_3", response("resp_3", "x"), [])
        assert await store.get("a", "resp_3") is not None
        assert not store._pending
    finally:
        store.close()


async def test_a_store_that_fails_says_so_as_a_store_error(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SQLite's own errors (here: locked past the busy timeout, as another process's long write
    # does) reached the routes as a 500; they are StoreErrors, and the store works again after.
    monkeypatch.setattr("server.store.BUSY_TIMEOUT_S", 0.2)
    path = str(tmp_path / "responses.db")
    store = opened(path, 1 << 20)
    other = sqlite3.connect(path, isolation_level=None)
    try:
        await store.put("t", "resp_1", response("resp_1", "kept"), [])
        other.execute("BEGIN EXCLUSIVE")
        with pytest.raises(StoreError, match="the responses store failed: database is locked"):
            await store.put("t", "resp_2", response("resp_2", "not now"), [])
        other.execute("ROLLBACK")
        assert await store.put("t", "resp_2", response("resp_2", "now"), [])
        got = await store.get("t", "resp_1")
        assert got is not None and got.response["id"] == "resp_1"
    finally:
        other.close()
        store.close()
