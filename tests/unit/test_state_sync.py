"""State sync and its loops survive what they meet: crashes restart, the store going away
is not a sync failure, a sync that keeps failing is reported (in-memory store)."""

from __future__ import annotations

import asyncio

from gateway.background import Background
from gateway.errors import StoreError
from gateway.policy import PolicySpec
from gateway.policy_book import PolicyBook
from gateway.services.policies import PolicyService
from gateway.services.state_sync import StateSync
from gateway.store.base import EventDraft, PolicyScan, StoredPolicy
from gateway.store.memory import InMemoryStore

SPEC = PolicySpec.model_validate({"weights": {"2": 100}})


async def test_a_supervised_loop_that_crashes_is_restarted_and_counted() -> None:
    background = Background()
    runs: list[int] = []
    crashes: list[str] = []
    done = asyncio.Event()

    async def flaky() -> None:
        runs.append(len(runs))
        if len(runs) < 3:
            raise ValueError(f"crash {len(runs)}")
        done.set()
        await asyncio.sleep(3600)

    background.supervise("flaky", flaky, lambda name, exc: crashes.append(f"{name}: {exc}"))
    await asyncio.wait_for(done.wait(), 5)
    assert background.restarts == {"flaky": 2} and crashes == ["flaky: crash 1", "flaky: crash 2"]
    await background.cancel_all()


class BrokenStore(InMemoryStore):
    """Scans fail the way it is told: a store outage, or a bug."""

    def __init__(self) -> None:
        super().__init__()
        self.failure: Exception | None = None

    async def scan_policies(self) -> PolicyScan:
        if self.failure is not None:
            raise self.failure
        return await super().scan_policies()


def make_sync(store: InMemoryStore, unready_after_s: float) -> StateSync:
    policies = PolicyService(store, PolicyBook(), triton=None)  # type: ignore[arg-type]  # sync never asks Triton
    return StateSync(store, policies, resync_interval_s=0.05, unready_after_s=unready_after_s)


async def test_an_unreachable_store_keeps_the_book_and_is_not_a_sync_failure() -> None:
    store = BrokenStore()
    await store.put_policy("qc", SPEC, 0, EventDraft("alice", "put"))
    sync = make_sync(store, unready_after_s=0.1)
    await sync.resync()
    sync.start()
    store.failure = StoreError("connection refused")
    await asyncio.sleep(0.4)
    assert not sync.store_up and sync.errors["store_unreachable"] >= 1
    assert sync.problem() is None, "the store being down is the store's alert, not a reason to stop serving"
    assert "qc" in sync.book.snapshot(), "the data path keeps the last policies"
    store.failure = None
    await asyncio.sleep(0.2)
    assert sync.store_up
    await sync.stop()


async def test_a_sync_that_keeps_failing_is_reported_after_the_allowed_time_then_recovers() -> None:
    store = BrokenStore()
    sync = make_sync(store, unready_after_s=0.3)
    await sync.resync()
    sync.start()
    store.failure = KeyError("a bug")
    await asyncio.sleep(0.15)
    assert sync.problem() is None, "not yet: a blip is allowed"
    await asyncio.sleep(0.4)
    problem = sync.problem()
    assert problem is not None and "policy sync has been failing" in problem and "KeyError" in problem
    assert sync.errors["internal"] >= 1 and sum(sync.restarts.values()) >= 1
    store.failure = None
    await asyncio.sleep(0.5)  # the restarted loop resyncs
    assert sync.problem() is None
    await sync.stop()


async def test_a_store_that_went_back_rebuilds_the_book_and_drops_vanished_models() -> None:
    store = InMemoryStore()
    for _ in range(3):
        await store.put_policy("qc", SPEC, None, EventDraft("alice", "put"))
    await store.put_policy("tok", SPEC, None, EventDraft("alice", "put"))
    sync = make_sync(store, unready_after_s=10)
    await sync.resync()
    assert sync.book.revision("qc") == 3
    # A failover to a replica that had only qc's first revision, and never tok.
    del store._policies["tok"]
    older = PolicySpec.model_validate({"weights": {"1": 100}})
    store._policies["qc"] = StoredPolicy("qc", older, 1, 0.0, await store.generation())
    await sync.refresh("qc")
    assert sync.book.revision("qc") == 1 and sync.book.snapshot()["qc"].spec == older
    assert sorted(sync.book.snapshot()) == ["qc"]
