"""The control plane is O(change): a policy put, a state-sync pass and the store's change feed
touch the model that changed, not the repository. Counted, never timed.

Before issue 36 the policy book copied every policy on each put (10 ms a PUT at 5,000 models),
each periodic resync (every 5 s) parsed every stored record again (0.3-0.5 s a pass at 5,000),
and the SQLite change feed listed every record's revision every 0.5 s with nothing changing.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, cast

import pytest

from gateway.policy import PolicySpec
from gateway.policy_book import PolicyBook
from gateway.services.policies import PolicyService
from gateway.services.state_sync import StateSync
from gateway.store.base import RESYNC, EventDraft
from gateway.store.sqlite import SQLiteStore

SPEC = PolicySpec.model_validate({"weights": {"2": 80, "3": 20}})
OTHER = PolicySpec.model_validate({"weights": {"2": 50, "3": 50}})


def test_a_put_into_a_5000_model_book_allocates_for_its_one_model() -> None:
    book = PolicyBook()
    book.rebuild("g", {f"m{index:05d}": (SPEC, 1) for index in range(5000)}, {})
    other = OTHER
    book.put("m00001", other, 2)  # warm: compiled-policy machinery
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        book.put("m04999", other, 2)
        allocated = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert allocated < 20_000, f"{allocated} bytes allocated by one put (copying 5,000 entries took ~100 KB)"
    assert book.get("m04999") is not None and len(book.snapshot()) == 5000
    frozen = book.snapshot()
    book.remove("m04998", 3)
    assert "m04998" in frozen and "m04998" not in book.snapshot(), "a snapshot does not change under its reader"


class Counted:
    def __init__(self) -> None:
        self.calls = 0


async def synced_book(store: SQLiteStore, models: int) -> tuple[PolicyBook, StateSync]:
    """``models`` policies stored, and a book brought to them by one resync pass."""
    for index in range(models):
        await store.put_policy(f"m{index:05d}", SPEC, None, EventDraft("test", "put_policy"))
    book = PolicyBook()
    sync = StateSync(store, PolicyService(store, book, None), resync_interval_s=60)  # type: ignore[arg-type]
    await sync.resync()
    return book, sync


async def test_a_resync_pass_parses_and_compiles_only_the_model_that_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SQLiteStore(tmp_path / "state.db")
    await store.open()
    try:
        book, sync = await synced_book(store, 1000)
        assert len(book.snapshot()) == 1000
        parses, compiles = Counted(), Counted()
        validate = PolicySpec.model_validate.__func__  # type: ignore[attr-defined]
        compile_policy = book.compile

        def counted_validate(cls: Any, *args: Any, **kwargs: Any) -> Any:
            parses.calls += 1
            return validate(cls, *args, **kwargs)

        def counted_compile(*args: Any, **kwargs: Any) -> Any:
            compiles.calls += 1
            return compile_policy(*args, **kwargs)

        monkeypatch.setattr(PolicySpec, "model_validate", classmethod(counted_validate))
        monkeypatch.setattr(book, "compile", counted_compile)
        await store.put_policy("m00500", OTHER, None, EventDraft("test", "put_policy"))
        parses.calls = 0
        await sync.resync()
        assert (parses.calls, compiles.calls) == (1, 1)
        policy = book.get("m00500")
        assert policy is not None and policy.revision == 2
    finally:
        await store.close()


async def test_the_sqlite_change_feed_lists_revisions_only_when_a_record_was_written(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "state.db", poll_s=0.001)
    await store.open()
    try:
        for index in range(200):
            await store.put_policy(f"m{index:05d}", SPEC, None, EventDraft("test", "put_policy"))
        statements: list[str] = []
        assert store._db is not None
        store._db.set_trace_callback(statements.append)
        feed = cast(AsyncGenerator[str, None], store.changes())
        assert await anext(feed) == RESYNC
        statements.clear()
        waiting = asyncio.ensure_future(anext(feed))
        while len(statements) < 40:  # twenty idle polls or so, each one statement or more
            await asyncio.sleep(0.005)
        listings = [sql for sql in statements if "FROM policies" in sql]
        assert listings == [], f"{len(listings)} full listings in {len(statements)} statements with nothing written"
        await store.put_policy("m00007", SPEC, 1, EventDraft("test", "put_policy"))
        assert await asyncio.wait_for(waiting, 5) == "m00007"
        await feed.aclose()
    finally:
        await store.close()


async def test_a_periodic_resync_reads_the_records_written_since_the_last_one_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resync every resync_interval_s (5 s) read all 5,000 records again, written or not
    (15-20 ms a pass): now it reads the records written since its last pass (by any process:
    each write stamps its record with the store's policy mark), and all of them only when the
    store cannot tell which (a hand edit, a model written twice since)."""
    import sqlite3

    import gateway.store.sqlite as sqlite_store

    path = tmp_path / "state.db"
    store = SQLiteStore(path)
    await store.open()
    try:
        book, sync = await synced_book(store, 1000)
        read = Counted()
        policy = sqlite_store._policy

        def counted_policy(*args: Any) -> Any:
            read.calls += 1
            return policy(*args)

        monkeypatch.setattr(sqlite_store, "_policy", counted_policy)
        for _ in range(3):
            await sync.resync()
        assert read.calls == 0, f"{read.calls} stored records read in 3 resync passes with nothing written"
        other = SQLiteStore(path)  # another process's writes, which no feed told us of
        await other.open()
        try:
            await other.put_policy("m00500", OTHER, None, EventDraft("test", "put_policy"))
            await other.put_policy("m00600", OTHER, None, EventDraft("test", "put_policy"))
        finally:
            await other.close()
        read.calls = 0  # (the writer's own reads)
        await sync.resync()
        assert read.calls == 2, f"{read.calls} records read for 2 written"
        assert all(getattr(book.get(m), "revision", 0) == 2 for m in ("m00500", "m00600"))
        read.calls = 0
        await sync.resync()
        assert read.calls == 0
        with sqlite3.connect(path) as db:  # a hand edit: counted by the triggers, not stamped
            db.execute("UPDATE policies SET revision = 3 WHERE model = 'm00700'")
        await sync.resync()
        assert read.calls == 1000 and getattr(book.get("m00700"), "revision", 0) == 3, "then all are read"
    finally:
        await store.close()
