"""SQLite store, the embedded default: one file, WAL mode, every change fsynced on commit.

Calls run in a worker thread (sqlite3 blocks) behind one lock; compare-and-set runs in a
``BEGIN IMMEDIATE`` transaction so several processes may share the file. The change feed
polls revisions: cheap, and it also picks up changes made by another process.

The generation id is made with the database file: a new (or deleted and re-created) file
is a new generation. The audit trail is trimmed in the transaction that appends to it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from gateway.errors import CorruptRecord, LeaseLost, StoreError
from gateway.policy import PolicySpec
from gateway.store.base import (
    RESYNC,
    WINDOW_PAGE,
    AppliedIntent,
    AuditBounds,
    Event,
    EventDraft,
    Fence,
    Guard,
    PolicyScan,
    ReplicaReport,
    StoredPolicy,
    StoredRollout,
    new_generation,
)
from gateway.store.budget import CALL_BUDGET_S
from gateway.store.memory import check_guard, check_revision, fence_message
from gateway.store.records import SpecCache, load_json, stored_spec

T = TypeVar("T")
log = logging.getLogger("gateway.store")
SCHEMA = """
CREATE TABLE IF NOT EXISTS policies (model TEXT PRIMARY KEY, spec TEXT, revision INTEGER NOT NULL,
                                     updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, actor TEXT NOT NULL,
                                   action TEXT NOT NULL, model TEXT NOT NULL, before TEXT, after TEXT, reason TEXT);
CREATE INDEX IF NOT EXISTS events_by_model ON events (model, id);
CREATE TABLE IF NOT EXISTS rollouts (model TEXT PRIMARY KEY, document TEXT NOT NULL, revision INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS leases (name TEXT PRIMARY KEY, holder TEXT NOT NULL, expires REAL NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS applied (model TEXT PRIMARY KEY, digest TEXT NOT NULL, revision INTEGER NOT NULL,
                                    at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS events_by_time ON events (at);
CREATE TABLE IF NOT EXISTS pins (key TEXT PRIMARY KEY, version TEXT NOT NULL, used_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS pins_used_at ON pins (used_at);
CREATE TABLE IF NOT EXISTS replicas (id TEXT PRIMARY KEY, report TEXT NOT NULL, expires REAL NOT NULL);
CREATE TABLE IF NOT EXISTS draining (model TEXT NOT NULL, version TEXT NOT NULL, drain_id TEXT NOT NULL,
                                     expires REAL NOT NULL, PRIMARY KEY (model, version));
CREATE TABLE IF NOT EXISTS fenced_leases (name TEXT PRIMARY KEY, holder TEXT NOT NULL, expires REAL NOT NULL,
                                          epoch INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS loaded_versions (model TEXT PRIMARY KEY, versions TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS windows (id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, replica TEXT NOT NULL,
                                    payload TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rollout_history (model TEXT NOT NULL, started_at REAL NOT NULL, document TEXT NOT NULL,
                                            PRIMARY KEY (model, started_at));
CREATE TABLE IF NOT EXISTS changes (id INTEGER PRIMARY KEY CHECK (id = 1), count INTEGER NOT NULL);
INSERT OR IGNORE INTO changes VALUES (1, 0);
CREATE TABLE IF NOT EXISTS policy_writes (id INTEGER PRIMARY KEY CHECK (id = 1), count INTEGER NOT NULL);
INSERT OR IGNORE INTO policy_writes VALUES (1, 0);
"""
# Every write of a policy or rollout record, by any connection (another replica, a hand edit),
# counts in `changes`: the change feed reads that one number each poll, and lists every record's
# revision only when it moved (listing them every 0.5 s cost O(models) with nothing changing).
TRIGGERS = "\n".join(
    f"CREATE TRIGGER IF NOT EXISTS {table}_{event.lower()} AFTER {event} ON {table} "
    "BEGIN UPDATE changes SET count = count + 1 WHERE id = 1; END;"
    for table in ("policies", "rollouts") for event in ("INSERT", "UPDATE", "DELETE")) + "\n" + "\n".join(
    # policy records alone, in `policy_writes`: the periodic resync reads every record only when it moved
    f"CREATE TRIGGER IF NOT EXISTS policies_{event.lower()}_mark AFTER {event} ON policies "
    "BEGIN UPDATE policy_writes SET count = count + 1 WHERE id = 1; END;" for event in ("INSERT", "UPDATE", "DELETE"))
POLICY_COLUMNS = "model, spec, revision, updated_at, actor"


BUSY_TIMEOUT_S = 5.0  # how long a call waits for another process's lock, unless its caller's budget is shorter


class SQLiteStore:
    def __init__(self, path: str | Path, poll_s: float = 0.5, audit: AuditBounds | None = None) -> None:
        self.path = Path(path)
        self.poll_s = poll_s
        self.audit = audit or AuditBounds()
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        # One thread of its own: calls run one at a time anyway, a call its caller gave up on
        # before it started is dropped from the queue, and calls stuck on a locked file never
        # take the threads the rest of the process shares (DNS lookups, to_thread).
        self._worker = _worker()
        self._generation = ""
        self._specs = SpecCache()  # a full read parses only the records whose text changed

    async def open(self) -> None:
        def connect() -> tuple[sqlite3.Connection, str]:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")  # durable before the API answers
            db.executescript(SCHEMA)
            db.executescript(TRIGGERS)
            columns = {row[1] for row in db.execute("PRAGMA table_info(policies)")}
            if "actor" not in columns:  # a file from before the writer was kept with the record
                db.execute("ALTER TABLE policies ADD COLUMN actor TEXT NOT NULL DEFAULT ''")
            if "written" not in columns:  # the policy mark at which the record was written (policies_since)
                db.execute("ALTER TABLE policies ADD COLUMN written INTEGER NOT NULL DEFAULT 0")
            db.execute("CREATE INDEX IF NOT EXISTS policies_by_written ON policies (written)")
            db.execute("INSERT OR IGNORE INTO meta VALUES ('generation', ?)", (new_generation(),))
            generation = db.execute("SELECT value FROM meta WHERE key = 'generation'").fetchone()[0]
            return db, str(generation)

        try:
            self._db, self._generation = await asyncio.get_running_loop().run_in_executor(self._worker, connect)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the state database {self.path}: {exc}") from exc

    async def generation(self) -> str:
        return self._generation

    async def close(self) -> None:
        if self._db is not None:
            db, self._db = self._db, None
            await asyncio.get_running_loop().run_in_executor(self._worker, db.close)
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._worker = _worker()  # its thread starts only if the store is opened again

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        budget = CALL_BUDGET_S.get()  # the caller's (a controller tick's): SQLite's own wait included

        def locked() -> T:
            db = self._db
            assert db is not None, "store used before open()"
            if not self._lock.acquire(timeout=-1 if budget is None else budget):
                raise sqlite3.OperationalError(f"the store's connection stayed busy for {budget:g}s")
            try:
                if budget is None:
                    return work(db)
                db.execute(f"PRAGMA busy_timeout = {int(min(budget, BUSY_TIMEOUT_S) * 1000)}")
                try:
                    return work(db)
                finally:
                    db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            finally:
                self._lock.release()

        try:
            return await asyncio.get_running_loop().run_in_executor(self._worker, locked)
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
            f"SELECT {POLICY_COLUMNS} FROM policies WHERE model = ?", (model,)).fetchall())
        return _policy(rows[0], self._generation, self._specs) if rows else None

    async def list_policies(self) -> dict[str, StoredPolicy]:
        return (await self.scan_policies()).policies

    async def scan_policies(self) -> PolicyScan:
        rows = await self._run(lambda db: db.execute(f"SELECT {POLICY_COLUMNS} FROM policies").fetchall())
        policies, corrupt = {}, {}
        for row in rows:
            try:
                policies[row[0]] = _policy(row, self._generation, self._specs)
            except CorruptRecord as exc:
                corrupt[row[0]] = exc.message
        self._specs.keep_only(policies)
        return PolicyScan(self._generation, policies, corrupt)

    async def policy_mark(self) -> str | None:
        row = await self._run(lambda db: db.execute("SELECT count FROM policy_writes WHERE id = 1").fetchone())
        return f"{self._generation}:{row[0] if row else 0}"

    async def policies_since(self, mark: str) -> tuple[str, dict[str, StoredPolicy]] | None:
        """The records written since ``mark`` (each write of ours stamps its record with the mark it
        makes), with the mark now; None when they cannot be told apart (another generation, a
        write that did not stamp its record: a hand edit, an older gateway, or a model written
        twice since): then read them all."""
        generation, _, count = mark.rpartition(":")
        if generation != self._generation or not count.isdigit():
            return None
        since = int(count)

        def read(db: sqlite3.Connection) -> tuple[int, list[Any]]:
            db.execute("BEGIN")  # the count and the rows of one moment
            try:
                now = db.execute("SELECT count FROM policy_writes WHERE id = 1").fetchone()
                rows = db.execute(f"SELECT {POLICY_COLUMNS} FROM policies WHERE written > ?", (since,)).fetchall()
            finally:
                db.execute("COMMIT")
            return (int(now[0]) if now else 0), rows

        now, rows = await self._run(read)
        if now < since or len(rows) != now - since:
            return None
        try:
            return f"{self._generation}:{now}", {row[0]: _policy(row, self._generation, self._specs) for row in rows}
        except CorruptRecord:
            return None  # the full read names it

    async def put_policy(self, model: str, spec: PolicySpec | None, expected_revision: int | None,
                         event: EventDraft, guard: Guard | None = None) -> StoredPolicy:
        return await self._run(lambda db: self._transaction(
            db, lambda: self._write_policy(db, model, spec, expected_revision, event, guard)))

    def _write_policy(self, db: sqlite3.Connection, model: str, spec: PolicySpec | None,
                      expected_revision: int | None, event: EventDraft, guard: Guard | None) -> StoredPolicy:
        """put_policy's statements, inside a transaction (the fenced write checks its fence first)."""
        rows = db.execute(f"SELECT {POLICY_COLUMNS} FROM policies WHERE model = ?", (model,)).fetchall()
        revision = rows[0][2] if rows else 0
        check_revision("policy", model, revision, expected_revision)
        _check_guard(db, model, guard)
        try:
            current = _policy(rows[0], self._generation, self._specs) if rows else None
        except CorruptRecord:  # overwriting a corrupt record is how it gets repaired
            current = None
        stored = StoredPolicy(model, spec, revision + 1, time.time(), self._generation, event.actor)
        db.execute(f"INSERT OR REPLACE INTO policies ({POLICY_COLUMNS}, written) VALUES (?, ?, ?, ?, ?, "
                   "(SELECT count + 1 FROM policy_writes WHERE id = 1))",  # the mark its insert trigger makes
                   (model, json.dumps(stored_spec(spec)) if spec else None, stored.revision, stored.updated_at,
                    event.actor))
        before = current.document() if current and current.spec else None
        self._insert_event(db, event.finish(model, before, stored.document() if spec else None))
        return stored

    async def append_event(self, model: str, event: Event) -> None:
        await self._run(lambda db: self._transaction(db, lambda: self._insert_event(db, event)))

    def _insert_event(self, db: sqlite3.Connection, event: Event) -> None:
        db.execute("INSERT INTO events (at, actor, action, model, before, after, reason) VALUES (?, ?, ?, ?, ?, ?, ?)",
                   (event.at, event.actor, event.action, event.model, json.dumps(event.before),
                    json.dumps(event.after), event.reason))
        # Ids only grow and only the oldest rows go, so they stay contiguous: this keeps the
        # newest max_events rows, by the primary key.
        db.execute("DELETE FROM events WHERE id <= (SELECT MAX(id) FROM events) - ?", (self.audit.max_events,))
        db.execute("DELETE FROM events WHERE at < ?", (time.time() - self.audit.max_age_s,))

    async def events(self, model: str | None = None, limit: int = 100) -> list[Event]:
        query = "SELECT id, at, actor, action, model, before, after, reason FROM events"
        args: tuple[Any, ...] = ()
        if model is not None:
            query += " WHERE model = ?"
            args = (model,)
        rows = await self._run(lambda db: db.execute(query + " ORDER BY id DESC LIMIT ?", (*args, limit)).fetchall())
        return [Event(id=r[0], at=r[1], actor=r[2], action=r[3], model=r[4], before=_load(r[5]), after=_load(r[6]),
                      reason=r[7]) for r in rows]

    async def count_events(self) -> int:
        """How many audit events the file holds (for operators and the bound's test)."""
        return int((await self._run(lambda db: db.execute("SELECT COUNT(*) FROM events").fetchone()))[0])

    async def get_rollout(self, model: str) -> StoredRollout | None:
        rows = await self._run(lambda db: db.execute(
            "SELECT model, document, revision FROM rollouts WHERE model = ?", (model,)).fetchall())
        return _rollout(rows[0]) if rows else None

    async def list_rollouts(self) -> dict[str, StoredRollout]:
        """Every readable rollout record (an unreadable one is logged and left out)."""
        rows = await self._run(lambda db: db.execute("SELECT model, document, revision FROM rollouts").fetchall())
        out = {}
        for row in rows:
            try:
                out[row[0]] = _rollout(row)
            except CorruptRecord as exc:
                log.warning("%s: skipped", exc.message)
        return out

    async def put_rollout(self, model: str, document: dict[str, Any], expected_revision: int | None,
                          guard: Guard | None = None) -> StoredRollout:
        return await self._run(lambda db: self._transaction(
            db, lambda: _write_rollout(db, model, document, expected_revision, guard)))

    async def delete_rollout(self, model: str, expected_revision: int) -> None:
        def work(db: sqlite3.Connection) -> None:
            def body() -> None:
                rows = db.execute("SELECT revision FROM rollouts WHERE model = ?", (model,)).fetchall()
                check_revision("rollout", model, rows[0][0] if rows else 0, expected_revision)
                db.execute("DELETE FROM rollouts WHERE model = ?", (model,))

            self._transaction(db, body)

        await self._run(work)

    async def archive_rollout(self, model: str, document: dict[str, Any], keep: int) -> None:
        text, started_at = json.dumps(document), float(document["started_at"])

        def body(db: sqlite3.Connection) -> None:
            db.execute("INSERT OR REPLACE INTO rollout_history VALUES (?, ?, ?)", (model, started_at, text))
            db.execute("DELETE FROM rollout_history WHERE model = ? AND started_at NOT IN (SELECT started_at FROM "
                       "rollout_history WHERE model = ? ORDER BY started_at DESC LIMIT ?)", (model, model, keep))

        await self._run(lambda db: self._transaction(db, lambda: body(db)))

    async def rollout_history(self, model: str, limit: int) -> list[dict[str, Any]]:
        rows = await self._run(lambda db: db.execute(
            "SELECT document FROM rollout_history WHERE model = ? ORDER BY started_at DESC LIMIT ?",
            (model, limit)).fetchall())
        return _readable_history(model, (row[0] for row in rows))

    async def get_applied(self, model: str) -> AppliedIntent | None:
        rows = await self._run(lambda db: db.execute(
            "SELECT digest, revision, at FROM applied WHERE model = ?", (model,)).fetchall())
        return AppliedIntent(rows[0][0], rows[0][1], rows[0][2]) if rows else None

    async def set_applied(self, model: str, intent: AppliedIntent) -> None:
        await self._run(lambda db: db.execute("INSERT OR REPLACE INTO applied VALUES (?, ?, ?, ?)",
                                              (model, intent.digest, intent.revision, intent.at)))

    async def changes(self) -> AsyncIterator[str]:
        count, seen = await self._change_count(), await self._revisions()
        yield RESYNC
        broken = False
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                now_count = await self._change_count()
                if now_count == count and not broken:
                    continue  # no policy or rollout was written: one number read, nothing listed
                now = await self._revisions()
            except StoreError as exc:
                if not broken:
                    log.warning("change poll failed (%s): retrying", exc)
                broken = True
                continue
            count = now_count
            if broken:  # changes made while we could not look are found by a full resync
                broken = False
                yield RESYNC
            for key, revision in now.items():
                if seen.get(key) != revision:
                    yield key[1]
            for key in seen.keys() - now.keys():
                yield key[1]  # a record removed behind our back
            seen = now

    async def _change_count(self) -> int:
        row = await self._run(lambda db: db.execute("SELECT count FROM changes WHERE id = 1").fetchone())
        return int(row[0]) if row else 0

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

    # -- fencing: the lease check runs in the same BEGIN IMMEDIATE transaction as the write ----
    async def acquire_fenced_lease(self, name: str, holder: str, ttl_s: float) -> int | None:
        def work(db: sqlite3.Connection) -> int | None:
            def body() -> int | None:
                now = time.time()
                row = db.execute("SELECT holder, expires, epoch FROM fenced_leases WHERE name = ?", (name,)).fetchone()
                if row is not None and row[1] > now and row[0] != holder:
                    return None
                epoch = row[2] if row is not None and row[1] > now else (row[2] if row else 0) + 1
                db.execute("INSERT OR REPLACE INTO fenced_leases VALUES (?, ?, ?, ?)",
                           (name, holder, now + ttl_s, epoch))
                return int(epoch)

            return self._transaction(db, body)

        return await self._run(work)

    async def renew_fenced_lease(self, name: str, holder: str, epoch: int, ttl_s: float) -> bool:
        def work(db: sqlite3.Connection) -> bool:
            def body() -> bool:
                now = time.time()
                cursor = db.execute("UPDATE fenced_leases SET expires = ? WHERE name = ? AND holder = ? AND epoch = ? "
                                    "AND expires > ?", (now + ttl_s, name, holder, epoch, now))
                return cursor.rowcount == 1

            return self._transaction(db, body)

        return await self._run(work)

    async def release_fenced_lease(self, name: str, holder: str, epoch: int) -> None:
        def work(db: sqlite3.Connection) -> None:
            def body() -> None:
                db.execute("UPDATE fenced_leases SET expires = 0 WHERE name = ? AND holder = ? AND epoch = ?",
                           (name, holder, epoch))

            self._transaction(db, body)

        await self._run(work)

    async def put_policy_fenced(self, model: str, spec: PolicySpec | None, expected_revision: int | None,
                                event: EventDraft, fence: Fence, guard: Guard | None = None) -> StoredPolicy:
        def work(db: sqlite3.Connection) -> StoredPolicy:
            def body() -> StoredPolicy:
                _check_fence(db, fence)
                return self._write_policy(db, model, spec, expected_revision, event, guard)

            return self._transaction(db, body)

        return await self._run(work)

    async def put_rollout_fenced(self, model: str, document: dict[str, Any], expected_revision: int | None,
                                 fence: Fence, guard: Guard | None = None) -> StoredRollout:
        def work(db: sqlite3.Connection) -> StoredRollout:
            def body() -> StoredRollout:
                _check_fence(db, fence)
                return _write_rollout(db, model, document, expected_revision, guard)

            return self._transaction(db, body)

        return await self._run(work)

    async def put_loaded_versions(self, model: str, versions: list[str]) -> None:
        text = json.dumps(sorted(versions, key=int))
        await self._run(lambda db: self._transaction(db, lambda: db.execute(
            "INSERT OR REPLACE INTO loaded_versions VALUES (?, ?)", (model, text))))

    async def loaded_versions(self) -> dict[str, list[str]]:
        rows = await self._run(lambda db: db.execute("SELECT model, versions FROM loaded_versions").fetchall())
        return {row[0]: json.loads(row[1]) for row in rows}

    async def release_lease(self, name: str, holder: str) -> None:
        await self._run(lambda db: db.execute("DELETE FROM leases WHERE name = ? AND holder = ?", (name, holder)))

    async def publish_windows(self, replica: str, payload: str, keep_s: float) -> None:
        def work(db: sqlite3.Connection) -> None:
            def body() -> None:
                now = time.time()
                db.execute("INSERT INTO windows (at, replica, payload) VALUES (?, ?, ?)", (now, replica, payload))
                db.execute("DELETE FROM windows WHERE at < ?", (now - keep_s,))  # the index on id finds the oldest

            self._transaction(db, body)

        await self._run(work)

    async def read_windows(self, cursor: str) -> tuple[str, list[tuple[str, str]]]:
        after = int(cursor or 0)
        rows = await self._run(lambda db: db.execute(
            "SELECT id, replica, payload FROM windows WHERE id > ? ORDER BY id LIMIT ?",
            (after, WINDOW_PAGE)).fetchall())
        return (str(rows[-1][0]) if rows else str(after)), [(str(row[1]), str(row[2])) for row in rows]

    async def report_replica(self, report: ReplicaReport, ttl_s: float) -> None:
        text = json.dumps(report.document())
        await self._run(lambda db: db.execute("INSERT OR REPLACE INTO replicas VALUES (?, ?, ?)",
                                              (report.replica, text, time.time() + ttl_s)))

    async def live_replicas(self) -> list[ReplicaReport]:
        rows = await self._run(lambda db: db.execute("SELECT report FROM replicas WHERE expires > ?",
                                                     (time.time(),)).fetchall())
        return _live_reports(rows)

    async def set_draining(self, model: str, version: str, drain_id: str | None, ttl_s: float = 0.0) -> None:
        if drain_id is None:
            await self._run(lambda db: db.execute("DELETE FROM draining WHERE model = ? AND version = ?",
                                                  (model, version)))
        else:
            await self._run(lambda db: db.execute("INSERT OR REPLACE INTO draining VALUES (?, ?, ?, ?)",
                                                  (model, version, drain_id, time.time() + ttl_s)))

    async def draining(self) -> dict[tuple[str, str], str]:
        rows = await self._run(lambda db: db.execute("SELECT model, version, drain_id FROM draining WHERE expires > ?",
                                                     (time.time(),)).fetchall())
        return {(r[0], r[1]): r[2] for r in rows}


    async def save_pins(self, changes: Mapping[str, tuple[str, float] | None], idle_s: float) -> None:
        def work(db: sqlite3.Connection) -> None:
            def body() -> None:
                for key, entry in changes.items():
                    if entry is None:
                        db.execute("DELETE FROM pins WHERE key = ?", (key,))
                    else:
                        db.execute("INSERT OR REPLACE INTO pins VALUES (?, ?, ?)", (key, entry[0], entry[1]))
                db.execute("DELETE FROM pins WHERE used_at < ?", (time.time() - idle_s,))

            self._transaction(db, body)

        await self._run(work)

    async def load_pins(self, idle_s: float) -> dict[str, tuple[str, float]]:
        rows = await self._run(lambda db: db.execute("SELECT key, version, used_at FROM pins WHERE used_at >= ?",
                                                     (time.time() - idle_s,)).fetchall())
        return {r[0]: (r[1], r[2]) for r in rows}

    async def load_pin(self, key: str, idle_s: float) -> tuple[str, float] | None:
        row = await self._run(lambda db: db.execute("SELECT version, used_at FROM pins WHERE key = ? AND used_at >= ?",
                                                    (key, time.time() - idle_s)).fetchone())
        return None if row is None else (row[0], row[1])


def _worker() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-store")


def _live_reports(rows: list[tuple[Any, ...]]) -> list[ReplicaReport]:
    reports = []
    for (text,) in rows:
        try:
            report = ReplicaReport.from_document(json.loads(text))
        except ValueError:
            report = None
        if report is not None:
            reports.append(report)
    return reports


def _policy(row: tuple[Any, ...], generation: str, specs: SpecCache) -> StoredPolicy:
    what = f"stored policy of model '{row[0]}' (revision {row[2]})"
    spec = specs.spec(row[0], row[1], what) if row[1] else None
    return StoredPolicy(row[0], spec, row[2], row[3], generation, row[4] or "")


def _rollout(row: tuple[Any, ...]) -> StoredRollout:
    document = load_json(row[1], f"stored rollout of model '{row[0]}'")
    if not isinstance(document, dict):
        raise CorruptRecord(f"stored rollout of model '{row[0]}' is not a JSON object")
    return StoredRollout(row[0], document, row[2])


def _readable_history(model: str, texts: Any) -> list[dict[str, Any]]:
    """Archived rollout documents; an unreadable one is logged and left out (it hides no other)."""
    out = []
    for text in texts:
        try:
            document = load_json(text, f"archived rollout of model '{model}'")
        except CorruptRecord as exc:
            log.warning("%s: skipped", exc.message)
            continue
        if isinstance(document, dict):
            out.append(document)
    return out


def _load(text: str | None) -> Any:
    return json.loads(text) if text else None


def _check_fence(db: sqlite3.Connection, fence: Fence) -> None:
    row = db.execute("SELECT holder, epoch FROM fenced_leases WHERE name = ?", (fence.name,)).fetchone()
    if row is None or (row[0], row[1]) != (fence.holder, fence.epoch):
        raise LeaseLost(fence_message(fence, row[1] if row else 0))


def _check_guard(db: sqlite3.Connection, model: str, guard: Guard | None) -> None:
    if guard is not None:
        table = "policies" if guard.kind == "policy" else "rollouts"
        row = db.execute(f"SELECT revision FROM {table} WHERE model = ?", (model,)).fetchone()
        check_guard(model, guard, row[0] if row else 0)


def _write_rollout(db: sqlite3.Connection, model: str, document: dict[str, Any],
                   expected_revision: int | None, guard: Guard | None) -> StoredRollout:
    """put_rollout's statements, inside a transaction (the fenced write checks its fence first)."""
    rows = db.execute("SELECT revision FROM rollouts WHERE model = ?", (model,)).fetchall()
    current = rows[0][0] if rows else 0
    check_revision("rollout", model, current, expected_revision)
    _check_guard(db, model, guard)
    db.execute("INSERT OR REPLACE INTO rollouts VALUES (?, ?, ?)", (model, json.dumps(document), current + 1))
    return StoredRollout(model, document, current + 1)
