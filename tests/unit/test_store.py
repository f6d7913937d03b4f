"""The StateStore contract, written once and run against every backend (Redis is real)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.errors import LeaseLost, StaleRevision
from gateway.policy import PolicySpec
from gateway.store.base import RESYNC, AppliedIntent, AuditBounds, EventDraft, Fence, Guard, StateStore, make_store

SPEC_A = PolicySpec.model_validate({"weights": {"2": 80, "3": 20}, "rules": []})
SPEC_B = PolicySpec.model_validate({"weights": {"2": 50, "3": 50},
                                    "rules": [{"header": "x-canary", "equals": "always", "version": "3"}]})


def store_url(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if kind == "memory":
        return "memory://"
    if kind == "sqlite":
        return f"sqlite:///{tmp_path}/state.db"
    return str(request.getfixturevalue("redis_url"))


@pytest.fixture(params=["memory", "sqlite", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StateStore]:
    backend = make_store(store_url(request.param, request, tmp_path))
    await backend.open()
    yield backend
    await backend.close()


async def test_policy_round_trip_with_growing_revisions(store: StateStore) -> None:
    assert await store.get_policy("qc") is None
    first = await store.put_policy("qc", SPEC_A, 0, EventDraft("alice", "put"))
    assert first.revision == 1 and first.spec == SPEC_A
    second = await store.put_policy("qc", SPEC_B, 1, EventDraft("bob", "put", reason="more canary"))
    assert second.revision == 2
    stored = await store.get_policy("qc")
    assert stored is not None and stored.spec == SPEC_B and stored.revision == 2
    assert (await store.list_policies())["qc"].revision == 2


async def test_a_policy_between_model_names_round_trips_as_written(store: StateStore) -> None:
    """Targets naming other models (and their versions, on fleets) come back as they were put,
    in their canonical spelling: the store keeps the policy's own strings."""
    weights = {"qc": 70, "qc_2026_12": 20, "qc_2026_12@2": 5, "green:qc_2026_12@1": 5}
    spec = PolicySpec.model_validate({"weights": weights,
                                      "rules": [{"header": "x-canary", "equals": "1", "version": "default:qc_2026_12"}],
                                      "shadow": {"version": "green:qc_2026_11", "percent": 5}})
    await store.put_policy("qc", spec, 0, EventDraft("alice", "put"))
    stored = await store.get_policy("qc")
    assert stored is not None and stored.spec == spec
    assert stored.document()["weights"] == weights
    assert stored.spec.rules[0].version == "qc_2026_12"  # "default:" is the default fleet, stored unnamed


async def test_stale_revision_changes_nothing(store: StateStore) -> None:
    await store.put_policy("qc", SPEC_A, 0, EventDraft("alice", "put"))
    with pytest.raises(StaleRevision, match="revision 1, not 0"):
        await store.put_policy("qc", SPEC_B, 0, EventDraft("bob", "put"))
    stored = await store.get_policy("qc")
    assert stored is not None and stored.spec == SPEC_A and stored.revision == 1
    assert len(await store.events("qc")) == 1


async def test_delete_leaves_a_tombstone_that_keeps_counting(store: StateStore) -> None:
    await store.put_policy("qc", SPEC_A, 0, EventDraft("config", "apply_config"))
    deleted = await store.put_policy("qc", None, 1, EventDraft("alice", "delete"))
    assert deleted.revision == 2 and deleted.spec is None
    with pytest.raises(StaleRevision):
        await store.put_policy("qc", SPEC_B, 0, EventDraft("config", "apply_config"))
    tombstone = await store.get_policy("qc")
    assert tombstone is not None and tombstone.spec is None and tombstone.revision == 2
    again = await store.put_policy("qc", SPEC_B, 2, EventDraft("alice", "put"))
    assert again.revision == 3


async def test_events_are_newest_first_and_filtered_by_model(store: StateStore) -> None:
    await store.put_policy("qc", SPEC_A, None, EventDraft("alice", "put", reason="first"))
    await store.put_policy("other", SPEC_A, None, EventDraft("bob", "put"))
    await store.put_policy("qc", SPEC_B, None, EventDraft("carol", "weights", reason="second"))
    events = await store.events("qc")
    assert [(e.actor, e.action, e.reason) for e in events] == [("carol", "weights", "second"),
                                                               ("alice", "put", "first")]
    assert events[0].before["weights"] == {"2": 80, "3": 20} and events[0].after["rules"][0]["version"] == "3"
    assert events[1].before is None
    assert len(await store.events(limit=2)) == 2
    assert events[0].at >= events[1].at


async def test_concurrent_compare_and_set_has_one_winner(store: StateStore) -> None:
    await store.put_policy("qc", SPEC_A, 0, EventDraft("alice", "put"))
    results = await asyncio.gather(*(store.put_policy("qc", SPEC_B, 1, EventDraft(f"sre{i}", "put"))
                                     for i in range(10)), return_exceptions=True)
    assert sum(not isinstance(r, Exception) for r in results) == 1
    assert all(isinstance(r, StaleRevision) for r in results if isinstance(r, Exception))


async def test_rollout_records_compare_and_set(store: StateStore) -> None:
    first = await store.put_rollout("qc", {"state": "progressing", "step": 0}, 0)
    assert first.revision == 1
    with pytest.raises(StaleRevision):
        await store.put_rollout("qc", {"state": "paused"}, 0)
    await store.put_rollout("qc", {"state": "paused", "list": []}, 1)
    stored = await store.get_rollout("qc")
    assert stored is not None and stored.document == {"state": "paused", "list": []} and stored.revision == 2
    assert list(await store.list_rollouts()) == ["qc"]


async def test_finished_rollouts_are_kept_newest_first_bounded_per_model(store: StateStore) -> None:
    """Issue 33: a rollout's record is replaced by the next one's; its archived copy stays, the
    same rollout archived twice is kept once (its newer copy), and past ``keep`` the oldest goes."""
    def finished(started_at: float, state: str) -> dict[str, object]:
        return {"model": "qc", "started_at": started_at, "state": state, "verdicts": [{"outcome": "unhealthy"}],
                "evidence": {"errors": {"log_lr": [0.5, 1.5]}}, "history": []}

    assert await store.rollout_history("qc", 10) == []
    await store.archive_rollout("qc", finished(100.0, "rolled_back"), keep=3)
    await store.archive_rollout("qc", finished(200.5, "aborted"), keep=3)
    await store.archive_rollout("qc", {**finished(100.0, "rolled_back"), "applied": True}, keep=3)  # again: replaced
    await store.archive_rollout("other", finished(150.0, "promoted"), keep=3)
    kept = await store.rollout_history("qc", 10)
    assert [(d["started_at"], d["state"]) for d in kept] == [(200.5, "aborted"), (100.0, "rolled_back")]
    assert kept[1]["applied"] is True and kept[1]["evidence"] == {"errors": {"log_lr": [0.5, 1.5]}}
    assert kept[1]["verdicts"] == [{"outcome": "unhealthy"}] and kept[1]["history"] == []
    for started_at in (300.0, 400.0, 500.0):
        await store.archive_rollout("qc", finished(started_at, "promoted"), keep=3)
    assert [d["started_at"] for d in await store.rollout_history("qc", 10)] == [500.0, 400.0, 300.0]
    assert [d["started_at"] for d in await store.rollout_history("qc", 2)] == [500.0, 400.0]
    assert [d["started_at"] for d in await store.rollout_history("other", 10)] == [150.0]
    assert list(await store.list_rollouts()) == []  # the history is no rollout record


async def test_change_feed_says_resync_once_live_then_announces_changed_models(store: StateStore) -> None:
    feed = store.changes()
    assert await asyncio.wait_for(feed.__anext__(), 2) == RESYNC, "live: the caller resyncs, nothing is missed"
    waiter = asyncio.ensure_future(feed.__anext__())
    await store.put_policy("qc", SPEC_A, None, EventDraft("alice", "put"))
    assert await asyncio.wait_for(waiter, 2) == "qc"
    await feed.aclose()  # type: ignore[attr-defined]


async def test_lease_has_one_holder_until_it_expires(store: StateStore) -> None:
    assert await store.acquire_lease("controller", "a", 0.3)
    assert not await store.acquire_lease("controller", "b", 0.3)
    assert await store.acquire_lease("controller", "a", 0.3), "the holder renews"
    await asyncio.sleep(0.4)
    assert await store.acquire_lease("controller", "b", 0.3)


def test_unknown_scheme_fails_loudly() -> None:
    with pytest.raises(ValueError, match="unknown store URL scheme"):
        make_store("postgres://x")


async def test_records_carry_the_store_generation_and_writer(store: StateStore) -> None:
    generation = await store.generation()
    assert generation and generation == await store.generation(), "one id, stable while the store lives"
    written = await store.put_policy("qc", SPEC_A, 0, EventDraft("alice", "put"))
    assert (written.generation, written.actor) == (generation, "alice")
    read = await store.get_policy("qc")
    assert read is not None and (read.generation, read.actor) == (generation, "alice")
    scan = await store.scan_policies()
    assert scan.generation == generation and list(scan.policies) == ["qc"] and scan.corrupt == {}


async def test_a_store_made_again_empty_has_a_new_generation(tmp_path: Path, redis_url: str) -> None:
    import redis.asyncio as aioredis

    first = make_store(f"sqlite:///{tmp_path}/a.db")
    await first.open()
    generation = await first.generation()
    await first.close()
    again = make_store(f"sqlite:///{tmp_path}/a.db")
    await again.open()
    assert await again.generation() == generation, "the same file is the same store"
    await again.close()
    other = make_store(f"sqlite:///{tmp_path}/b.db")
    await other.open()
    assert await other.generation() != generation
    await other.close()

    shared = make_store(redis_url)
    await shared.open()
    before = await shared.put_policy("qc", SPEC_A, 0, EventDraft("alice", "put"))
    client = aioredis.Redis.from_url(redis_url)
    await client.flushall()
    await client.aclose()
    after = await shared.put_policy("qc", SPEC_B, 0, EventDraft("bob", "put"))
    assert after.revision == before.revision == 1, "the wiped store starts counting again..."
    assert after.generation != before.generation, "...so the generation is what tells replicas"
    assert (await shared.get_policy("qc")).generation == after.generation  # type: ignore[union-attr]
    await shared.close()


async def test_rollout_record_delete_is_compare_and_set(store: StateStore) -> None:
    await store.put_rollout("qc", {"state": "progressing"}, 0)
    with pytest.raises(StaleRevision):
        await store.delete_rollout("qc", 2)
    assert await store.get_rollout("qc") is not None
    await store.delete_rollout("qc", 1)
    assert await store.get_rollout("qc") is None and await store.list_rollouts() == {}
    assert (await store.put_rollout("qc", {"state": "progressing"}, 0)).revision == 1


async def test_config_intent_round_trip(store: StateStore) -> None:
    assert await store.get_applied("qc") is None
    await store.set_applied("qc", AppliedIntent("abc", 3, 1700000000.5))
    await store.set_applied("qc", AppliedIntent("def", 4, 1700000001.5))
    assert await store.get_applied("qc") == AppliedIntent("def", 4, 1700000001.5)
    assert await store.get_applied("other") is None


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis"])
async def test_audit_trail_is_bounded_by_count_and_by_age(kind: str, request: pytest.FixtureRequest,
                                                          tmp_path: Path) -> None:
    backend = make_store(store_url(kind, request, tmp_path), AuditBounds(max_events=5, max_age_s=0.5))
    await backend.open()
    for index in range(8):
        await backend.put_policy("qc", SPEC_A, None, EventDraft("alice", "put", reason=str(index)))
    assert [e.reason for e in await backend.events()] == ["7", "6", "5", "4", "3"], "the newest 5 stay"
    await asyncio.sleep(0.6)  # every line is now older than the age bound
    await backend.put_policy("qc", SPEC_B, None, EventDraft("alice", "put", reason="8"))
    assert [e.reason for e in await backend.events()] == ["8"], "the aged lines went"
    await backend.close()


NEWER_RECORD = {"weights": {"2": 90, "3": 10}, "sticky_header": None, "canary_budget": 3,
                "rules": [{"header": "x-canary", "equals": "always", "version": "3", "priority": 1}]}


async def write_raw(kind: str, where: str, model: str, spec_json: str, revision: int = 4) -> None:
    """Writes a policy record behind the store's back, as a bug or a newer version could."""
    if kind == "sqlite":
        import sqlite3

        db = sqlite3.connect(where)
        db.execute("INSERT OR REPLACE INTO policies (model, spec, revision, updated_at) VALUES (?, ?, ?, ?)",
                   (model, spec_json, revision, 1.0))
        db.commit()
        db.close()
    else:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(where)
        record = f'{{"revision": {revision}, "model": "{model}", "updated_at": 1.0, "spec": {spec_json}}}'
        await client.set(f"gateway:policy:{model}", record)
        await client.aclose()


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_unreadable_records_are_named_apart_and_newer_fields_ignored(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import json

    from gateway.errors import CorruptRecord
    from gateway.store import records

    records._warned.clear()  # once per process: forget what an earlier test reported
    url = store_url(kind, request, tmp_path)
    backend = make_store(url)
    await backend.open()
    where = f"{tmp_path}/state.db" if kind == "sqlite" else url
    await backend.put_policy("qc", SPEC_A, 0, EventDraft("alice", "put"))
    await write_raw(kind, where, "broken", "{not json" if kind == "sqlite" else '{"weights": ')
    await write_raw(kind, where, "invalid", json.dumps({"weights": {"2": 90}}))
    await write_raw(kind, where, "newer", json.dumps(NEWER_RECORD))
    for _ in range(2):
        scan = await backend.scan_policies()
        assert sorted(scan.policies) == ["newer", "qc"]
        assert sorted(scan.corrupt) == ["broken", "invalid"] and "sum to 100" in scan.corrupt["invalid"]
    newer = scan.policies["newer"].spec
    assert newer is not None and newer.basis_points() == {"2": 9000, "3": 1000}
    assert newer.rules[0].version == "3"
    unknown = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert len(unknown) == 2 and "canary_budget" in unknown[0] + unknown[1] and "rules.*.priority" in "".join(unknown)
    with pytest.raises(CorruptRecord, match="broken"):
        await backend.get_policy("broken")
    assert sorted(await backend.list_policies()) == ["newer", "qc"]
    repaired = await backend.put_policy("broken", SPEC_B, None, EventDraft("alice", "repair"))
    assert (await backend.get_policy("broken")) == repaired
    await backend.close()


async def test_sqlite_audit_trail_stays_within_its_bound_over_10000_changes(tmp_path: Path) -> None:
    """The acceptance bound, on a real file (in /dev/shm when there is one: same SQLite, no
    disk flush per change, so 10,000 durable writes take seconds)."""
    import tempfile

    from gateway.store.sqlite import SQLiteStore

    shm = Path("/dev/shm")
    folder = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() else tmp_path
    backend = SQLiteStore(folder / "state.db", audit=AuditBounds(max_events=1000))
    await backend.open()
    try:
        largest = 0
        for index in range(10_000):
            spec = SPEC_A if index % 2 else SPEC_B
            await backend.put_policy(f"model{index % 7}", spec, None, EventDraft("alice", "put", reason=str(index)))
            if index % 500 == 499:
                largest = max(largest, await backend.count_events())
        assert largest == 1000 and await backend.count_events() == 1000
        newest = await backend.events(limit=1000)
        assert [e.reason for e in newest[:2]] == ["9999", "9998"] and newest[-1].reason == "9000"
    finally:
        await backend.close()
        if folder != tmp_path:
            import shutil

            shutil.rmtree(folder)


async def test_replica_reports_and_drain_marks_expire(store: StateStore, request: pytest.FixtureRequest,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Expiry is judged on the store's clock: the memory and SQLite stores read it in Python, so
    the test sets it (on the wall clock the SQLite case failed once under a loaded machine, its
    0.3 s marks expired before the first read). Redis expires them itself, on its own clock: that
    case waits in real time, with a second of room."""
    from gateway.store.base import ReplicaReport

    clock: StoreClock | None = None
    if request.node.callspec.params["store"] != "redis":
        clock = StoreClock(time.time(), monotonic=True)
        monkeypatch.setattr(sys.modules[type(store).__module__], "time", clock)
    short = 0.3 if clock is not None else 1.0
    await store.report_replica(ReplicaReport("a", 1.0, {"qc/3": (2, 1, "d1")}), ttl_s=short)
    await store.report_replica(ReplicaReport("b", 1.0, {}), ttl_s=5)
    await store.report_replica(ReplicaReport("a", 2.0, {"qc/3": (0, 1, "d1")}), ttl_s=short)  # replaces a's report
    reports = {r.replica: r for r in await store.live_replicas() if r.replica in ("a", "b")}
    assert sorted(reports) == ["a", "b"] and reports["a"].usage == {"qc/3": (0, 1, "d1")}
    await store.set_draining("qc", "3", "d1", ttl_s=short)
    await store.set_draining("tok", "1", "d2", ttl_s=5)
    assert await store.draining() == {("qc", "3"): "d1", ("tok", "1"): "d2"}
    await store.set_draining("tok", "1", None)
    if clock is not None:
        clock.now += short + 0.1
    else:
        await asyncio.sleep(short + 0.1)
    live = [r.replica for r in await store.live_replicas() if r.replica in ("a", "b")]  # only this test's
    assert live == ["b"], "a stopped reporting: it is gone"
    assert await store.draining() == {}


async def test_a_lease_is_released_only_by_its_holder(store: StateStore) -> None:
    assert await store.acquire_lease("lifecycle:qc", "a", 10)
    await store.release_lease("lifecycle:qc", "b")
    assert not await store.acquire_lease("lifecycle:qc", "b", 10)
    await store.release_lease("lifecycle:qc", "a")
    assert await store.acquire_lease("lifecycle:qc", "b", 10)


class StoreClock:
    """``time`` for a store module: ``time()`` (and ``monotonic()`` when asked) is the test's,
    everything else the real module's."""

    def __init__(self, now: float, monotonic: bool = False) -> None:
        self.now = now
        self._monotonic = monotonic

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now if self._monotonic else time.monotonic()

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


async def test_sequence_pins_are_kept_until_idle(store: StateStore, request: pytest.FixtureRequest,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle is judged on the store's clock. The memory and SQLite stores read it in Python, so the
    test sets it: their answers no longer depend on how long the calls took. On the wall clock the
    SQLite case failed twice under a loaded machine (once with 0.15 s margins, once on 2026-12-06
    with 1 s margins, in a parallel run at load ~14; its message was not kept), which takes more
    than a second between the test's ``now`` and its first load; neither fsync stalls (<= 0.06 s
    per commit under 4 writers with O_DSYNC), CPU starvation (<= 0.04 s under 40 busy loops on its
    core), clock steps (none in 90 s) nor steal time (18 s in 2 h) came near that in isolation.
    Redis expires pins itself, on its own clock: that case waits for the expiry in real time."""
    now = time.time()
    clock: StoreClock | None = None
    if request.node.callspec.params["store"] != "redis":
        clock = StoreClock(now)
        monkeypatch.setattr(sys.modules[type(store).__module__], "time", clock)
    started = time.monotonic()
    await store.save_pins({'["qc", 7]': ("3", now), '["qc", "s-1"]': ("2", now - 4.0), '["qc", 8]': ("3", now)},
                          idle_s=5.0)
    await store.save_pins({'["qc", 8]': None}, idle_s=5.0)  # ended
    took = time.monotonic() - started
    assert await store.load_pins(5.0) == {'["qc", 7]': ("3", now), '["qc", "s-1"]': ("2", now - 4.0)}, (
        f"{took:.2f} s after the first save")
    if clock is not None:
        clock.now = now + 1.2
    else:
        await asyncio.sleep(1.2)
    assert list(await store.load_pins(5.0)) == ['["qc", 7]'], "s-1 was last used 5.2 s ago: idle, gone"


@pytest.mark.parametrize("fenced", [False, True], ids=["plain", "fenced"])
async def test_a_guarded_write_lands_only_while_the_other_record_is_where_it_was_read(
        store: StateStore, fenced: bool) -> None:
    """A rollout record announces a policy write only while the policy is the one it read, and
    the policy write lands only while that announcement is the newest rollout record (issue 23:
    an abort and a controller tick must not interleave into a lost abort). A refused write
    changes neither record."""
    epoch = await store.acquire_fenced_lease("controller", "a", 5)
    assert epoch is not None
    fence = Fence("controller", "a", epoch)

    async def put_rollout(document: dict[str, object], expected: int, guard: Guard) -> object:
        if fenced:
            return await store.put_rollout_fenced("qc", document, expected, fence, guard)
        return await store.put_rollout("qc", document, expected, guard)

    async def put_policy(spec: PolicySpec, expected: int, guard: Guard) -> object:
        if fenced:
            return await store.put_policy_fenced("qc", spec, expected, EventDraft("a", "put"), fence, guard)
        return await store.put_policy("qc", spec, expected, EventDraft("a", "put"), guard)

    await put_rollout({"state": "progressing"}, 0, Guard("policy", 0))  # no policy yet: revision 0
    await put_policy(SPEC_A, 0, Guard("rollout", 1))
    with pytest.raises(StaleRevision, match="policy of model 'qc' moved to revision 1"):
        await put_rollout({"state": "aborted"}, 1, Guard("policy", 0))
    with pytest.raises(StaleRevision, match="rollout of model 'qc' moved to revision 1"):
        await put_policy(SPEC_B, 1, Guard("rollout", 0))
    rollout, policy = await store.get_rollout("qc"), await store.get_policy("qc")
    assert rollout is not None and rollout.revision == 1 and rollout.document == {"state": "progressing"}
    assert policy is not None and policy.revision == 1 and policy.spec == SPEC_A
    assert len(await store.events("qc")) == 1, "a refused policy write appends no audit event"
    await put_rollout({"state": "aborted"}, 1, Guard("policy", 1))
    assert (await store.get_rollout("qc")).revision == 2  # type: ignore[union-attr]


async def test_fenced_lease_epoch_grows_only_when_the_lease_changes_hands(store: StateStore) -> None:
    first = await store.acquire_fenced_lease("controller", "a", 0.3)
    assert first is not None
    assert await store.acquire_fenced_lease("controller", "b", 0.3) is None
    assert await store.acquire_fenced_lease("controller", "a", 0.3) == first, "renewing keeps the epoch"
    await asyncio.sleep(0.4)
    assert await store.acquire_fenced_lease("controller", "b", 0.3) == first + 1


async def test_a_fenced_lease_is_renewed_only_by_its_live_holder_and_given_up_at_once(store: StateStore) -> None:
    """What the controller's lease keeper relies on: a renewal extends a live lease at its epoch
    and never takes back one that lapsed; giving it up lets the next holder in without waiting."""
    epoch = await store.acquire_fenced_lease("controller", "a", 0.3)
    assert epoch is not None
    assert await store.renew_fenced_lease("controller", "a", epoch, 0.3)
    assert not await store.renew_fenced_lease("controller", "b", epoch, 0.3), "not b's"
    assert not await store.renew_fenced_lease("controller", "a", epoch + 1, 0.3), "not at another epoch"
    await asyncio.sleep(0.4)
    assert not await store.renew_fenced_lease("controller", "a", epoch, 0.3), "a lapsed lease is not taken back"
    assert await store.acquire_fenced_lease("controller", "b", 5) == epoch + 1
    await store.release_fenced_lease("controller", "a", epoch)  # not a's any more: nothing happens
    assert await store.acquire_fenced_lease("controller", "c", 5) is None
    await store.release_fenced_lease("controller", "b", epoch + 1)
    assert await store.acquire_fenced_lease("controller", "c", 5) == epoch + 2, "at once, not after the TTL"


async def test_replicas_windows_are_read_in_order_a_page_at_a_time_and_kept_for_a_while(store: StateStore) -> None:
    assert (await store.read_windows(""))[1] == []
    await store.publish_windows("a", '{"n": 1}', 60)
    await store.publish_windows("b", '{"n": 2}', 60)
    cursor, entries = await store.read_windows("")
    assert entries == [("a", '{"n": 1}'), ("b", '{"n": 2}')]
    assert (await store.read_windows(cursor))[1] == [], "caught up"
    await store.publish_windows("a", '{"n": 3}', 60)
    later, entries = await store.read_windows(cursor)
    assert entries == [("a", '{"n": 3}')] and (await store.read_windows(later))[1] == []
    await asyncio.sleep(1.1)
    await store.publish_windows("c", '{"n": 4}', 1.0)  # what is older than a second goes
    kept = (await store.read_windows(""))[1]
    assert kept[-1] == ("c", '{"n": 4}') and ("a", '{"n": 1}') not in kept


async def test_a_deposed_holders_fenced_writes_are_refused(store: StateStore) -> None:
    epoch_a = await store.acquire_fenced_lease("controller", "a", 0.2)
    assert epoch_a is not None
    fence_a = Fence("controller", "a", epoch_a)
    written = await store.put_policy_fenced("qc", SPEC_A, 0, EventDraft("a", "put"), fence_a)
    rollout = await store.put_rollout_fenced("qc", {"step": 0}, 0, fence_a)
    assert (written.revision, rollout.revision) == (1, 1)
    await asyncio.sleep(0.3)
    epoch_b = await store.acquire_fenced_lease("controller", "b", 5)
    assert epoch_b == epoch_a + 1
    with pytest.raises(LeaseLost, match="deposed"):
        await store.put_policy_fenced("qc", SPEC_B, 1, EventDraft("a", "put"), fence_a)
    with pytest.raises(LeaseLost):
        await store.put_rollout_fenced("qc", {"step": 1}, 1, fence_a)
    stored = await store.get_policy("qc")
    assert stored is not None and stored.revision == 1 and stored.spec == SPEC_A, "the refused write changed nothing"
    assert (await store.get_rollout("qc")).document == {"step": 0}  # type: ignore[union-attr]
    fence_b = Fence("controller", "b", epoch_b)
    assert (await store.put_policy_fenced("qc", SPEC_B, 1, EventDraft("b", "put"), fence_b)).revision == 2
    with pytest.raises(StaleRevision):
        await store.put_rollout_fenced("qc", {"step": 1}, 0, fence_b)


async def test_fenced_writes_need_the_lease(store: StateStore) -> None:
    with pytest.raises(LeaseLost):
        await store.put_rollout_fenced("qc", {}, None, Fence("controller", "a", 1))


async def test_loaded_versions_are_kept_per_model(store: StateStore) -> None:
    assert await store.loaded_versions() == {}
    await store.put_loaded_versions("qc", ["3", "10", "2"])
    await store.put_loaded_versions("tok", ["1"])
    await store.put_loaded_versions("qc", ["2", "3"])
    assert await store.loaded_versions() == {"qc": ["2", "3"], "tok": ["1"]}


async def test_sqlite_calls_on_a_budget_give_up_on_another_processs_lock_within_it(tmp_path: Path) -> None:
    """Issue 23: a store call made on a budget (a controller tick's) waits for another
    connection's BEGIN EXCLUSIVE no longer than the budget, SQLite's busy timeout included (it
    was 5 s for every call), and the connection is free again for the next call once the
    budget has run out. Calls without a budget keep the 5 s busy timeout."""
    import sqlite3

    from gateway.errors import StoreError
    from gateway.store.budget import bounded, call_budget
    from gateway.store.sqlite import BUSY_TIMEOUT_S

    backend = make_store(f"sqlite:///{tmp_path}/state.db")
    await backend.open()
    store = bounded(backend)
    locker = sqlite3.connect(tmp_path / "state.db", isolation_level=None, check_same_thread=False)
    locker.execute("BEGIN EXCLUSIVE")
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        with call_budget(0.3) as budget:
            with pytest.raises(StoreError):
                await store.put_policy("qc", SPEC_A, 0, EventDraft("alice", "put"))
            assert loop.time() - started < 1.0 and budget.failure is not None
            with pytest.raises(StoreError, match="not asked again"):  # the tick's next call is not even tried
                await store.get_policy("qc")
        await asyncio.sleep(0.4)  # the worker thread gave up too: the connection is free
        # A read (WAL) goes through the lock, on the connection the put's worker held. Had that
        # worker kept it for the 5 s busy timeout, or the read waited for the lock, the read would
        # spend this whole budget and raise; 2 s, not 0.3 s: how soon its thread runs on a loaded
        # machine is no part of what is shown.
        with call_budget(2.0):
            assert await store.get_policy("qc") is None
        started = loop.time()
        with pytest.raises(StoreError):  # no budget: SQLite's own busy timeout
            await store.put_policy("qc", SPEC_A, 0, EventDraft("alice", "put"))
        assert loop.time() - started >= BUSY_TIMEOUT_S * 0.9
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert (await store.put_policy("qc", SPEC_A, 0, EventDraft("alice", "put"))).revision == 1
    await backend.close()
