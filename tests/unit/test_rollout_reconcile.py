"""The level-triggered controller tick by tick: store failures, crashes between writes, humans
writing during a tick, deposed lease holders, and a fast path that only fires for the canary."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.errors import LeaseLost, StoreError
from gateway.policy import PolicySpec
from gateway.rollout.controller import RolloutController
from gateway.rollout.lease import LEASE
from gateway.rollout.spec import RolloutSpec
from gateway.services.policies import PolicyService
from gateway.store.base import EventDraft, Fence
from gateway.store.memory import InMemoryStore
from gateway.telemetry.recorder import Window
from tests.unit.test_rollout_controller import SPEC, FakeSource, Harness
from tests.unit.test_rollout_gradual_controller import BROKEN, FAILING, GRADUAL, HEALTHY


class FlakyStore(InMemoryStore):
    """The in-memory store with switches: writes fail (SQLite locked), everything fails (Redis
    stopped), nothing answers (silent: a call waits until the switch is off), or the process
    'dies' right after the next policy write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes_fail = False
        self.down = False
        self.silent = False
        self.crash_after_policy_write = False

    async def _answer(self, write: bool) -> None:
        while self.silent:
            await asyncio.sleep(0.01)
        self._check(write)

    def _check(self, write: bool) -> None:
        if self.down or (write and self.writes_fail):
            raise StoreError("state store unavailable (test switch)")

    async def acquire_fenced_lease(self, *args: Any, **kwargs: Any) -> Any:
        await self._answer(True)
        return await super().acquire_fenced_lease(*args, **kwargs)

    async def get_policy(self, model: str) -> Any:
        await self._answer(False)
        return await super().get_policy(model)

    async def list_rollouts(self) -> Any:
        await self._answer(False)
        return await super().list_rollouts()

    async def put_policy(self, *args: Any, **kwargs: Any) -> Any:
        await self._answer(True)
        stored = await super().put_policy(*args, **kwargs)
        if self.crash_after_policy_write:
            self.crash_after_policy_write = False
            raise asyncio.CancelledError("killed between the policy write and the rollout write")
        return stored

    async def put_policy_fenced(self, *args: Any, **kwargs: Any) -> Any:
        await self._answer(True)
        return await super().put_policy_fenced(*args, **kwargs)

    async def put_rollout(self, *args: Any, **kwargs: Any) -> Any:
        await self._answer(True)
        return await super().put_rollout(*args, **kwargs)

    async def put_rollout_fenced(self, *args: Any, **kwargs: Any) -> Any:
        await self._answer(True)
        return await super().put_rollout_fenced(*args, **kwargs)

    async def append_event(self, *args: Any, **kwargs: Any) -> None:
        await self._answer(True)
        await super().append_event(*args, **kwargs)


class SlowSource(FakeSource):
    """Metrics that wait for the test: a tick held open on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()

    async def window(self, model: str, version: str, seconds: float) -> Window:
        if self.gate is not None:
            self.entered.set()
            await self.gate.wait()
        return await super().window(model, version, seconds)


@pytest.fixture
async def h() -> Harness:
    harness = Harness()
    harness.store = FlakyStore()
    harness.policies = PolicyService(harness.store, harness.book, harness.triton)  # type: ignore[arg-type]
    harness.source = SlowSource()
    harness.controller = harness.new_controller()
    await harness.policies.put("qc", PolicySpec.model_validate({"weights": {"2": 100}}), 0, EventDraft("sre", "put"))
    return harness


def store_of(h: Harness) -> FlakyStore:
    assert isinstance(h.store, FlakyStore)
    return h.store


def book_weights(h: Harness) -> dict[str, int]:
    policy = h.book.get("qc")
    assert policy is not None
    return {v: int(w) for v, w in policy.spec.weights.items() if w}


async def test_a_rollback_whose_policy_write_failed_is_retried_until_applied(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    original = store_of(h).put_policy

    async def refuse(*args: Any, **kwargs: Any) -> Any:
        raise StoreError("database is locked")

    store_of(h).put_policy = refuse  # type: ignore[method-assign]
    h.triton.ready["3"] = False
    await h.interval(canary=(100, 0, 0.004), seconds=0.5)
    state = await h.state()
    assert (state["state"], state["applied"]) == ("rolled_back", False)
    assert await h.weights() == {"2": 95, "3": 5}, "the write failed"
    assert book_weights(h) == {"2": 100}, "but this replica already sends the canary nothing"
    store_of(h).put_policy = original  # type: ignore[method-assign]
    await h.interval(canary=(100, 0, 0.004), seconds=0.5)
    state = await h.state()
    assert (state["state"], state["applied"]) == ("rolled_back", True) and await h.weights() == {"2": 100}
    for _ in range(3):  # settled: nothing more is written
        await h.interval(canary=(100, 0, 0.004), seconds=0.5)
    assert (await h.store.get_policy("qc")).revision == state["policy_revision"]  # type: ignore[union-attr]


async def test_an_sre_patch_during_a_slow_tick_pauses_and_is_kept(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    source = h.source
    assert isinstance(source, SlowSource)
    source.gate = asyncio.Event()
    source.windows = {"3": (100, 0, 0.004), "2": (1000, 0, 0.004)}
    h.clock.now += 10
    tick = asyncio.ensure_future(h.controller.tick())
    await asyncio.wait_for(source.entered.wait(), 1)  # the tick waits on the metrics now
    await h.policies.set_weights("qc", {"2": 70, "3": 30}, None, EventDraft("bob", "set_weights"))
    source.gate.set()
    await tick
    state = await h.state()
    assert state["state"] == "paused" and "bob" in state["reason"]
    assert await h.weights() == {"2": 70, "3": 30}, "the SRE's weights stand"
    await h.interval(canary=(100, 0, 0.004))
    assert await h.weights() == {"2": 70, "3": 30} and (await h.state())["state"] == "paused"


async def test_a_crash_between_the_policy_write_and_the_rollout_write_resumes_at_the_same_step(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    store_of(h).crash_after_policy_write = True
    with pytest.raises(asyncio.CancelledError):
        await h.interval(canary=(100, 0, 0.004))
    assert await h.weights() == {"2": 80, "3": 20}, "the policy was written"
    stored = (await h.state())
    assert stored["step"] == 1 and stored["pending_revision"] == (await h.store.get_policy("qc")).revision  # type: ignore[union-attr]
    h.controller = h.new_controller()  # the restarted process
    await h.interval(canary=(100, 0, 0.004), seconds=0.5)
    state = await h.state()
    assert (state["state"], state["step"], state["applied"]) == ("progressing", 1, True), state["reason"]
    await h.interval(canary=(100, 0, 0.004))
    assert (await h.state())["step"] == 2 and (await h.weights())["3"] == 50


@pytest.mark.parametrize("outage", ["writes_fail", "down"])
async def test_store_down_the_holder_rolls_back_locally_then_persists(h: Harness, outage: str) -> None:
    spec = RolloutSpec.model_validate({**SPEC.model_dump(), "failure_limit": 1})
    await h.controller.begin("qc", spec, "alice")
    await h.interval(canary=(100, 0, 0.004), seconds=0.5)  # remembers the rollout list
    setattr(h.store, outage, True)
    await h.interval(canary=(100, 50, 0.004))
    assert book_weights(h) == {"2": 100}, "the canary gets 0% on this replica during the outage"
    setattr(h.store, outage, False)
    stored = await h.store.get_rollout("qc")
    assert stored is not None and stored.document["state"] == "progressing", "the store has not heard yet"
    await h.interval(canary=(0, 0, 0.004), seconds=0.5)
    state = await h.state()
    assert (state["state"], state["applied"]) == ("rolled_back", True), state["apply_reason"]
    assert await h.weights() == {"2": 100} and "error rate" in state["reason"]
    assert h.recorder.rollbacks == {("qc", "error_rate"): 1}, "counted once, with the metric that decided it"


async def test_a_silent_store_holds_no_tick_and_the_rollback_reaches_the_book_within_two_ticks(h: Harness) -> None:
    """Issue 23: a store that never answers (SQLite locked by another process, a hung Redis).
    Each store call of a tick gets the call timeout, and after the first one fails the tick
    asks nothing more: the lease holder's decided rollback reaches its own book within two
    ticks, and the store gets it when it answers again (fenced, as ever). Before, the lease
    renewal waited on the store for as long as it was silent."""
    h.controller = RolloutController(h.store, h.triton, h.policies, h.source, h.recorder,  # type: ignore[arg-type]
                                     clock=h.clock, call_timeout_s=0.2, lease_ttl_s=2.0)
    spec = RolloutSpec.model_validate({**SPEC.model_dump(), "failure_limit": 1})
    await h.controller.begin("qc", spec, "alice")
    await h.controller.lead()
    assert h.controller.fence is not None
    store_of(h).silent = True
    h.source.windows = {"3": (100, 50, 0.004), "2": (1000, 0, 0.004)}
    h.clock.now += 10
    loop = asyncio.get_running_loop()
    for tick in range(2):
        started = loop.time()
        await asyncio.wait_for(h.controller.lead(), 5)
        assert loop.time() - started < 1.5, f"tick {tick} waited on the silent store"
        if book_weights(h) == {"2": 100}:
            break
    assert book_weights(h) == {"2": 100}, "the canary at 0% on the lease holder while the store is silent"
    stored = await h.store.get_rollout("qc")
    assert stored is not None and stored.document["state"] == "progressing", "the store has not heard yet"
    store_of(h).silent = False
    await h.controller.lead()
    state = await h.state()
    assert (state["state"], state["applied"]) == ("rolled_back", True), state["apply_reason"]
    assert await h.weights() == {"2": 100}


async def test_a_resume_served_by_another_replica_resets_the_lease_holders_fast_path(h: Harness) -> None:
    """Issue 23: two replicas on one store, each with its own data path (recorder). The lease
    holder saw the canary fail (version unavailable) while the rollout was paused; the SRE's
    resume reaches the other replica. The holder counts from the resume (the moment is in the
    record): the resumed canary is not rolled back for failures seen during the pause. Before,
    only the replica that served the resume reset its counts, and the holder rolled back at once."""
    from gateway.policy_book import PolicyBook
    from gateway.telemetry.recorder import Recorder

    holder = h.controller
    other_policies = PolicyService(h.store, PolicyBook(), h.triton)  # type: ignore[arg-type]
    other = RolloutController(h.store, h.triton, other_policies, h.source, Recorder(),  # type: ignore[arg-type]
                              clock=h.clock)
    await holder.begin("qc", SPEC, "alice")
    await holder.lead()
    assert holder.fence is not None
    h.source.windows = {"3": (100, 0, 0.004), "2": (1000, 0, 0.004)}
    await holder.lead()  # the holder's fast path has looked at the canary
    await other.command("qc", "pause", "bob")
    h.recorder.upstream_error("qc", "3", "VersionUnavailable")  # on the holder's data path, during the pause
    h.clock.now += 1
    await holder.lead()
    assert (await h.state())["state"] == "paused"
    await other.command("qc", "resume", "bob")
    assert other.fence is None, "the resume was served by the replica without the lease"
    h.clock.now += 0.5
    await holder.lead()
    state = await h.state()
    assert state["state"] == "progressing", state["reason"]
    h.recorder.upstream_error("qc", "3", "VersionUnavailable")  # after the resume: counted
    await holder.lead()
    state = await h.state()
    assert state["state"] == "rolled_back" and "VersionUnavailable" in state["reason"], state["reason"]


async def test_an_abort_whose_first_write_meets_the_holders_advance_is_applied_to_what_the_tick_left(
        h: Harness) -> None:
    """Issue 23, the other order of the abort race (the integration test forces the first): the
    lease holder's tick advances and writes its policy after the abort (served by another
    replica) read both records, before the abort announced its own write. The announcement is
    refused (the policy moved), and the abort reads both records again and is applied on top
    of the advance."""
    from gateway.policy_book import PolicyBook

    holder = h.controller
    other = RolloutController(h.store, h.triton, PolicyService(h.store, PolicyBook(), h.triton),  # type: ignore[arg-type]
                              h.source, h.recorder, clock=h.clock)
    await holder.begin("qc", SPEC, "alice")
    await holder.lead()
    h.source.windows = {"3": (100, 0, 0.004), "2": (1000, 0, 0.004)}
    h.clock.now += 10  # the holder's next tick advances
    write = h.store.put_rollout
    raced: list[int] = []

    async def holder_ticks_first(*args: Any, **kwargs: Any) -> Any:
        if not raced:
            raced.append((await h.weights())["3"])
            await holder.lead()
            raced.append((await h.weights())["3"])
        return await write(*args, **kwargs)

    h.store.put_rollout = holder_ticks_first  # type: ignore[method-assign]
    result = await other.command("qc", "abort", "bob")
    assert raced == [5, 20], "the holder advanced between the abort's reads and its write"
    assert result.phase.value == "aborted" and result.applied
    assert await h.weights() == {"2": 100}
    await holder.lead()
    state = await h.state()
    assert (state["state"], state["applied"]) == ("aborted", True) and await h.weights() == {"2": 100}


async def test_a_deposed_holders_writes_are_refused(h: Harness) -> None:
    other = RolloutController(h.store, h.triton, h.policies, h.source, h.recorder,  # type: ignore[arg-type]
                              clock=h.clock, lease_ttl_s=0.2)
    h.controller = RolloutController(h.store, h.triton, h.policies, h.source, h.recorder,  # type: ignore[arg-type]
                                     clock=h.clock, lease_ttl_s=0.2)
    await h.controller.begin("qc", SPEC, "alice")
    epoch = await h.store.acquire_fenced_lease(LEASE, h.controller.holder, 0.2)
    assert epoch is not None
    h.controller.fence = Fence(LEASE, h.controller.holder, epoch)
    source = h.source
    assert isinstance(source, SlowSource)
    source.gate = asyncio.Event()
    source.windows = {"3": (100, 0, 0.004), "2": (1000, 0, 0.004)}
    h.clock.now += 10
    deposed = asyncio.ensure_future(h.controller.tick(h.controller.fence))
    await asyncio.wait_for(source.entered.wait(), 1)
    await asyncio.sleep(0.3)  # the lease lapses mid-tick...
    source.gate.set()
    await other.lead()  # ...and the other replica takes it (epoch + 1) and moves the rollout on
    assert other.fence is not None and other.fence.epoch == epoch + 1
    before = await h.store.get_rollout("qc")
    await deposed  # the deposed tick tries to write its verdict
    after = await h.store.get_rollout("qc")
    assert after == before, "the deposed holder's write was refused"
    assert h.controller.fence is None
    with pytest.raises(LeaseLost):
        await h.store.put_rollout_fenced("qc", {}, None, Fence(LEASE, h.controller.holder, epoch))


async def test_connection_errors_alone_never_roll_back(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    for _ in range(3):
        h.recorder.upstream_error("qc", "3", "UpstreamUnavailable")
    await h.interval(canary=(10, 0, 0.004), seconds=0.5)
    assert (await h.state())["state"] == "progressing"


async def test_a_triton_restart_at_the_last_step_does_not_roll_back(h: Harness) -> None:
    spec = RolloutSpec.model_validate({**SPEC.model_dump(), "steps": [50, 100]})
    await h.controller.begin("qc", spec, "alice")
    await h.interval(canary=(100, 0, 0.004))
    assert (await h.weights()) == {"3": 100}
    h.triton.ready = {"1": False, "2": False, "3": False}  # Triton restarting: nothing is READY
    h.recorder.upstream_error("qc", "3", "VersionUnavailable")
    await h.interval(canary=(0, 0, 0.004), seconds=0.5)
    assert (await h.state())["state"] == "progressing", "stable not READY either: Triton's trouble, not the canary's"
    h.triton.ready = {"1": True, "2": True, "3": False}  # the stable came back, the canary did not
    await h.interval(canary=(0, 0, 0.004), seconds=0.5)
    assert (await h.state())["state"] == "rolled_back"


async def test_a_paused_rollouts_weights_are_left_alone(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    await h.controller.command("qc", "pause", "bob")
    h.triton.ready["3"] = False
    await h.interval(canary=(100, 90, 0.004))
    state = await h.state()
    assert state["state"] == "paused" and await h.weights() == {"2": 95, "3": 5}


async def test_a_rollback_to_a_stable_that_is_not_ready_keeps_traffic_where_it_is_served(h: Harness) -> None:
    spec = RolloutSpec.model_validate({**SPEC.model_dump(), "failure_limit": 1})
    await h.controller.begin("qc", spec, "alice")
    h.triton.ready["2"] = False
    await h.interval(canary=(100, 50, 0.004))
    state = await h.state()
    assert (state["state"], state["applied"]) == ("rolled_back", False)
    assert "2 is not READY" in state["apply_reason"] and await h.weights() == {"2": 95, "3": 5}
    assert h.recorder.rollback_blocked["qc"] == 1
    h.triton.ready["2"] = True
    await h.interval(canary=(0, 0, 0.004), seconds=0.5)
    state = await h.state()
    assert (state["state"], state["applied"]) == ("rolled_back", True) and await h.weights() == {"2": 100}
    assert h.recorder.rollback_blocked["qc"] == 0


async def test_errors_from_an_interval_in_which_triton_could_not_serve_are_no_versions_fault(h: Harness) -> None:
    spec = RolloutSpec.model_validate({**SPEC.model_dump(), "failure_limit": 1})
    await h.controller.begin("qc", spec, "alice")
    h.triton.ready = {"1": False, "2": False, "3": False}  # Triton restarting mid-interval
    await h.interval(canary=(0, 0, 0.004), seconds=0.5)
    h.triton.ready = {"1": True, "2": True, "3": True}
    await h.interval(canary=(100, 60, 0.004), stable=(900, 540, 0.004), seconds=9.5)
    state = await h.state()
    assert state["state"] == "progressing", state["reason"]
    assert state["verdicts"][-1]["outcome"] == "inconclusive" and "could not serve" in state["verdicts"][-1]["reason"]


async def test_store_down_a_gradual_rollback_steps_down_on_this_replica_and_a_critical_failure_still_zeroes(
        h: Harness) -> None:
    """The descent moves traffic away from a rejected canary: like a rollback to 0 it goes into
    this replica's book at once, whether or not the store answers, and a critical failure
    during the outage is not left waiting for a step's weights the store never took."""
    await h.controller.begin("qc", GRADUAL, "alice")
    for _ in range(3):
        await h.interval(canary=HEALTHY)
    assert await h.weights() == {"3": 100}
    store_of(h).down = True
    for _ in range(2):  # failure_limit unhealthy intervals at 100%
        await h.interval(canary=FAILING, stable=(0, 0, 0.004))
    assert book_weights(h) == {"2": 50, "3": 50}, "the first step down serves at once, store or no store"
    await h.interval(canary=FAILING, stable=(0, 0, 0.004))
    assert book_weights(h) == {"2": 50, "3": 50}, "no further step down before this one is in the store"
    await h.interval(canary=BROKEN, stable=(0, 0, 0.004))
    assert book_weights(h) == {"2": 100}, "a critical error rate goes to 0 at once, mid-outage"
    store_of(h).down = False
    await h.interval(canary=(0, 0, 0.004), seconds=0.5)
    state = await h.state()
    assert (state["state"], state["applied"]) == ("rolled_back", True), state["apply_reason"]
    assert await h.weights() == {"2": 100} and "during the gradual rollback" in state["reason"]


async def test_a_bug_in_one_models_tick_does_not_stop_the_others(h: Harness) -> None:
    await h.policies.put("tok", PolicySpec.model_validate({"weights": {"2": 100}}), 0, EventDraft("sre", "put"))
    await h.controller.begin("qc", SPEC, "alice")
    await h.controller.begin("tok", SPEC, "alice")
    judge = h.controller._judge

    async def broken_for_qc(rollout: Any, now: float) -> Any:
        if rollout.model == "qc":
            raise AttributeError("'list' object has no attribute 'get'")  # what a bad Prometheus answer once did
        return await judge(rollout, now)

    h.controller._judge = broken_for_qc  # type: ignore[method-assign]
    for _ in range(2):
        await h.interval(canary=(100, 0, 0.004))
    tok = await h.controller.status("tok")
    assert tok["step"] == 2, "tok moved on although qc's tick raised"
    assert (await h.state())["step"] == 0
