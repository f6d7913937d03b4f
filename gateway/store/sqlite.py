"""SQLite store, the embedded default: one file, WAL mode, every change fsynced on commit.

Calls run in a worker thread (sqlite3 blocks) behind one lock; compare-and-set runs in a
``BEGIN IMMEDIATE`` transaction so several processes may share the file. The change feed
polls revisions: cheap, and it also picks up changes made by another process.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

from gateway.errors import StoreError
from gateway.policy import PolicySpec
from gateway.store.base import Event, EventDraft, StoredPolicy, StoredRollout, seed_once
from gateway.store.memory import check_revision

T = TypeVar("T")
SCHEMA = """
CREATE TABLE IF NOT EXISTS policies (model TEXT PRIMARY KEY, spec TEXT, revision INTEGER NOT NULL,
                                     updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, actor TEXT NOT NULL,
                                   action TEXT NOT NULL, model TEXT NOT NULL, before TEXT, after TEXT, reason TEXT);
CREATE INDEX IF NOT EXISTS events_by_model ON events (model, id);
CREATE TABLE IF NOT EXISTS rollouts (model TEXT PRIMARY KEY, document TEXT NOT NULL, revision INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS leases (name TEXT PRIMARY KEY, holder TEXT NOT NULL, expires REAL NOT NULL);
"""


class SQLiteStore:
    def __init__(self, path: str | Path, poll_s: float = 0.5) -> None:
        self.path = Path(path)
        self.poll_s = poll_s
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    async def open(self) -> None:
        def connect() -> sqlite3.Connection:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=5.0)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")  # durable before the API answers
            db.executescript(SCHEMA)
            return db

        try:
            self._db = await asyncio.to_thread(connect)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the state database {self.path}: {exc}") from exc

    async def close(self) -> None:
        if self._db is not None:
            db, self._db = self._db, None
            await asyncio.to_thread(db.close)

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        def locked() -> T:
            assert self._db is not None, "store used before open()"
            with self._lock:
                return work(self._db)

        try:
            return await asyncio.to_thread(locked)
        except sqlite3.Error as exc:
            raise StoreError(f"state database {self.path}: {exc}") from exc

    def _transaction(self, db: sqlite3.Connection, body: Callable[[], T]) -> T:
        db.execute("BEGIN IMMEDIATE")
        try:
            result = body()
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return result

    async def get_policy(self, model: str) -> StoredPolicy | None:
        rows = await self._run(lambda db: db.execute(
            "SELECT model, spec, revision, updated_at FROM policies WHERE model = ?", (model,)).fetchall())
        return _policy(rows[0]) if rows else None

    async def list_policies(self) -> dict[str, StoredPolicy]:
        query = "SELECT model, spec, revision, updated_at FROM policies"
        rows = await self._run(lambda db: db.execute(query).fetchall())
        return {row[0]: _policy(row) for row in rows}

    async def put_policy(self, model: str, spec: PolicySpec | None, expected_revision: int | None,
                         event: EventDraft) -> StoredPolicy:
        def work(db: sqlite3.Connection) -> StoredPolicy:
            def body() -> StoredPolicy:
                rows = db.execute("SELECT model, spec, revision, updated_at FROM policies WHERE model = ?",
                                  (model,)).fetchall()
                current = _policy(rows[0]) if rows else None
                check_revision("policy", model, current.revision if current else 0, expected_revision)
                stored = StoredPolicy(model, spec, (current.revision if current else 0) + 1, time.time())
                db.execute("INSERT OR REPLACE INTO policies VALUES (?, ?, ?, ?)",
                           (model, json.dumps(spec.document()) if spec else None, stored.revision, stored.updated_at))
                before = current.document() if current and current.spec else None
                _insert_event(db, event.finish(model, before, stored.document() if spec else None))
                return stored

            return self._transaction(db, body)

        return await self._run(work)

    async def seed_policy(self, model: str, spec: PolicySpec, actor: str) -> bool:
        return await seed_once(self, model, spec, actor)

    async def append_event(self, model: str, event: Event) -> None:
        await self._run(lambda db: self._transaction(db, lambda: _insert_event(db, event)))

    async def events(self, model: str | None = None, limit: int = 100) -> list[Event]:
        query = "SELECT id, at, actor, action, model, before, after, reason FROM events"
        args: tuple[Any, ...] = ()
        if model is not None:
            query += " WHERE model = ?"
            args = (model,)
        rows = await self._run(lambda db: db.execute(query + " ORDER BY id DESC LIMIT ?", (*args, limit)).fetchall())
        return [Event(id=r[0], at=r[1], actor=r[2], action=r[3], model=r[4], before=_load(r[5]), after=_load(r[6]),
                      reason=r[7]) for r in rows]

    async def get_rollout(self, model: str) -> StoredRollout | None:
        rows = await self._run(lambda db: db.execute(
            "SELECT model, document, revision FROM rollouts WHERE model = ?", (model,)).fetchall())
        return StoredRollout(rows[0][0], json.loads(rows[0][1]), rows[0][2]) if rows else None

    async def list_rollouts(self) -> dict[str, StoredRollout]:
        rows = await self._run(lambda db: db.execute("SELECT model, document, revision FROM rollouts").fetchall())
        return {r[0]: StoredRollout(r[0], json.loads(r[1]), r[2]) for r in rows}

    async def put_rollout(self, model: str, document: dict[str, Any], expected_revision: int | None) -> StoredRollout:
        def work(db: sqlite3.Connection) -> StoredRollout:
            def body() -> StoredRollout:
                rows = db.execute("SELECT revision FROM rollouts WHERE model = ?", (model,)).fetchall()
                current = rows[0][0] if rows else 0
                check_revision("rollout", model, current, expected_revision)
                db.execute("INSERT OR REPLACE INTO rollouts VALUES (?, ?, ?)",
                           (model, json.dumps(document), current + 1))
                return StoredRollout(model, document, current + 1)

            return self._transaction(db, body)

        return await self._run(work)

    async def changes(self) -> AsyncIterator[str]:
        seen = await self._revisions()
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                now = await self._revisions()
            except StoreError:
                continue  # the periodic resync in the caller heals this
            for key, revision in now.items():
                if seen.get(key) != revision:
                    yield key[1]
            seen = now

    async def _revisions(self) -> dict[tuple[str, str], int]:
        rows = await self._run(lambda db: db.execute(
            "SELECT 'p', model, revision FROM policies UNION ALL SELECT 'r', model, revision FROM rollouts").fetchall())
        return {(r[0], r[1]): r[2] for r in rows}

    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        def work(db: sqlite3.Connection) -> bool:
            def body() -> bool:
                now = time.time()
                row = db.execute("SELECT holder, expires FROM leases WHERE name = ?", (name,)).fetchone()
                if row is not None and row[0] != holder and row[1] > now:
                    return False
                db.execute("INSERT OR REPLACE INTO leases VALUES (?, ?, ?)", (name, holder, now + ttl_s))
                return True

            return self._transaction(db, body)

        return await self._run(work)


def _policy(row: tuple[Any, ...]) -> StoredPolicy:
    spec = PolicySpec.model_validate(json.loads(row[1])) if row[1] else None
    return StoredPolicy(row[0], spec, row[2], row[3])


def _insert_event(db: sqlite3.Connection, event: Event) -> None:
    db.execute("INSERT INTO events (at, actor, action, model, before, after, reason) VALUES (?, ?, ?, ?, ?, ?, ?)",
               (event.at, event.actor, event.action, event.model, json.dumps(event.before), json.dumps(event.after),
                event.reason))


def _load(text: str | None) -> Any:
    return json.loads(text) if text else None
