"""``server/store.py`` without a server: the responses store's tenants, bound, file sharing (as a
hot restart's two processes share it) and close."""

from __future__ import annotations

import pathlib

import pytest
import trio

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
