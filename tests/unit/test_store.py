"""The StateStore contract, written once and run against every backend (Redis is real)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.errors import StaleRevision
from gateway.policy import PolicySpec
from gateway.store.base import EventDraft, StateStore, make_store

SPEC_A = PolicySpec.model_validate({"weights": {"2": 80, "3": 20}, "rules": []})
SPEC_B = PolicySpec.model_validate({"weights": {"2": 50, "3": 50},
                                    "rules": [{"header": "x-canary", "equals": "always", "version": "3"}]})


@pytest.fixture(params=["memory", "sqlite", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StateStore]:
    if request.param == "memory":
        url = "memory://"
    elif request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/state.db"
    else:
        url = request.getfixturevalue("redis_url")
    backend = make_store(url)
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


async def test_stale_revision_changes_nothing(store: StateStore) -> None:
    await store.put_policy("qc", SPEC_A, 0, EventDraft("alice", "put"))
    with pytest.raises(StaleRevision, match="revision 1, not 0"):
        await store.put_policy("qc", SPEC_B, 0, EventDraft("bob", "put"))
    stored = await store.get_policy("qc")
    assert stored is not None and stored.spec == SPEC_A and stored.revision == 1
    assert len(await store.events("qc")) == 1


async def test_delete_leaves_a_tombstone_and_seed_never_overwrites(store: StateStore) -> None:
    assert await store.seed_policy("qc", SPEC_A, "settings") is True
    assert await store.seed_policy("qc", SPEC_B, "settings") is False
    deleted = await store.put_policy("qc", None, 1, EventDraft("alice", "delete"))
    assert deleted.revision == 2 and deleted.spec is None
    assert await store.seed_policy("qc", SPEC_B, "settings") is False, "a deleted policy stays deleted"
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


async def test_change_feed_announces_changed_models(store: StateStore) -> None:
    feed = store.changes()
    waiter = asyncio.ensure_future(feed.__anext__())
    await asyncio.sleep(0.1)  # let the feed subscribe before the change
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
