"""The controller tick by tick, with a fake clock, fake metrics and a fake Triton."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.errors import Conflict, MetricsUnavailable, StoreError, UpstreamUnavailable
from gateway.fleet.reads import ServerReads
from gateway.policy import PolicySpec
from gateway.policy_book import PolicyBook
from gateway.rollout.controller import RolloutController
from gateway.rollout.spec import RolloutSpec
from gateway.rollout.warmup import WarmupSpec
from gateway.services.policies import PolicyService
from gateway.services.triton_control import VersionState
from gateway.store.base import EventDraft
from gateway.store.memory import InMemoryStore
from gateway.telemetry.recorder import LATENCY_BOUNDS, Recorder, Window
from tests.support import HookReceiver


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class FakeSource:
    def __init__(self) -> None:
        self.windows: dict[str, tuple[int, int, float]] = {}  # version -> (requests, errors, latency)
        self.broken = False

    async def window(self, model: str, version: str, seconds: float) -> Window:
        if self.broken:
            raise MetricsUnavailable("prometheus down")
        requests, errors, latency = self.windows.get(version, (0, 0, 0.004))
        hist = [0] * (len(LATENCY_BOUNDS) + 1)
        hist[next(i for i, b in enumerate(LATENCY_BOUNDS) if latency <= b)] = requests
        return Window(model, version, seconds, requests, errors, 0, tuple(hist))


class FakeTriton:
    def __init__(self) -> None:
        self.ready = {"1": True, "2": True, "3": True}

    async def versions(self, model: str) -> dict[str, VersionState]:
        return {v: VersionState(v, "READY" if r else "UNAVAILABLE", "") for v, r in self.ready.items()}

    def servers_of(self, key: str) -> list[Any]:
        return []  # no server to read Triton's statistics or configs from: the verdicts say so

    async def target_states(self, model: str, keys: set[str]) -> tuple[dict[str, VersionState], bool]:
        states = await self.versions(model)
        return {key: states[key] for key in keys if key in states}, False

    async def require_ready(self, model: str, versions: set[str]) -> None:
        for version in versions:
            if not self.ready.get(version):
                raise Conflict(f"version {version} of model '{model}' is not READY")

    async def is_version_ready(self, model: str, version: str) -> bool | None:
        return self.ready.get(version, False)


class Harness:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.source = FakeSource()
        self.triton = FakeTriton()
        self.store = InMemoryStore()
        self.book = PolicyBook()
        self.recorder = Recorder()
        self.policies = PolicyService(self.store, self.book, self.triton)  # type: ignore[arg-type]
        self.controller = self.new_controller()

    def new_controller(self, lifecycle: Any = None) -> RolloutController:
        return RolloutController(self.store, self.triton, self.policies, self.source,  # type: ignore[arg-type]
                                 self.recorder, clock=self.clock, lifecycle=lifecycle)

    async def weights(self) -> dict[str, Any]:
        stored = await self.store.get_policy("qc")
        assert stored is not None and stored.spec is not None
        return {v: int(w) for v, w in stored.spec.weights.items() if w}

    async def state(self) -> dict[str, Any]:
        return await self.controller.status("qc")

    async def stop_after_webhooks(self, count: int) -> None:
        """Wait (up to 2 s) until ``count`` webhooks of qc were delivered, then a little longer,
        so that anything sent twice would have arrived too, and stop the controller."""
        for _ in range(100):
            if self.controller.hooks.status("qc")["delivered"] >= count:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        await self.controller.stop()

    async def interval(self, canary: tuple[int, int, float], stable: tuple[int, int, float] = (1000, 0, 0.004),
                       seconds: float = 10) -> None:
        self.source.windows = {"3": canary, "2": stable}
        self.clock.now += seconds
        await self.controller.tick()


SPEC = RolloutSpec(canary="3", steps=[5, 20, 50, 100], interval_s=10, min_requests=50, judge="thresholds")


@pytest.fixture
async def h() -> Harness:
    harness = Harness()
    await harness.policies.put("qc", PolicySpec.model_validate({"weights": {"2": 100}}), 0, EventDraft("sre", "put"))
    return harness


async def test_healthy_canary_is_promoted_step_by_step(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    assert await h.weights() == {"2": 95, "3": 5}
    assert h.book.get("qc").spec.weights["3"] == 5  # type: ignore[union-attr]
    for expected in (20, 50, 100):
        await h.interval(canary=(100, 0, 0.004))
        assert (await h.weights())["3"] == expected
    await h.interval(canary=(100, 0, 0.004))
    state = await h.state()
    assert state["state"] == "promoted" and await h.weights() == {"3": 100}
    actions = [e.action for e in await h.store.events("qc")]
    assert "rollout_started" in actions and "rollout_promoted" in actions


async def test_a_tick_during_a_start_leaves_the_first_step_to_the_start(h: Harness) -> None:
    """A tick between the start's record write and its policy write wrote the first step itself,
    and the start then failed on its own rollout (412 "policy of model 'qc' is at revision 2,
    not 1", twice in parallel runs right after a gateway's start)."""
    put_rollout = h.store.put_rollout
    ticked: list[bool] = []

    async def and_a_tick(*args: Any, **kwargs: Any) -> Any:
        stored = await put_rollout(*args, **kwargs)
        if not ticked:
            ticked.append(True)
            await h.controller.tick()  # the loop's tick, landing in the middle of the start
        return stored

    h.store.put_rollout = and_a_tick  # type: ignore[method-assign]
    await h.controller.begin("qc", SPEC, "alice")
    assert ticked and await h.weights() == {"2": 95, "3": 5}
    assert (await h.store.get_policy("qc")).revision == 2  # type: ignore[union-attr]  # one write: the start's
    assert (await h.state())["state"] == "progressing"


async def test_ticks_before_the_interval_ends_do_nothing(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    await h.interval(canary=(100, 0, 0.004), seconds=5)
    assert (await h.state())["step"] == 0 and (await h.state())["verdicts"] == []


async def test_unhealthy_canary_rolls_back_at_the_failure_limit(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    await h.interval(canary=(100, 30, 0.004))
    assert (await h.state())["state"] == "progressing"
    await h.interval(canary=(100, 30, 0.004))
    state = await h.state()
    assert state["state"] == "rolled_back" and await h.weights() == {"2": 100}
    assert state["verdicts"][-1]["metric"] == "error_rate" and state["verdicts"][-1]["observed"] == 0.3
    assert state["canary_requests"] == 200
    assert h.recorder.rollbacks == {("qc", "error_rate"): 1}
    for _ in range(5):  # stays rolled back: no flapping, no silent retry
        await h.interval(canary=(100, 0, 0.004))
    assert (await h.state())["state"] == "rolled_back"


async def test_slow_canary_rolls_back_on_latency(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    await h.interval(canary=(100, 0, 0.25), stable=(1000, 0, 0.004))
    await h.interval(canary=(100, 0, 0.25), stable=(1000, 0, 0.004))
    state = await h.state()
    assert state["state"] == "rolled_back" and state["verdicts"][-1]["metric"] == "p99_ratio"


async def test_too_little_traffic_holds(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    for _ in range(10):
        await h.interval(canary=(10, 5, 0.25))
    state = await h.state()
    assert (state["state"], state["step"]) == ("progressing", 0)
    assert {v["outcome"] for v in state["verdicts"]} == {"inconclusive"}


async def test_metric_errors_pause_instead_of_rolling_back(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    h.source.broken = True
    for _ in range(3):
        await h.interval(canary=(0, 0, 0.004))
    state = await h.state()
    assert state["state"] == "paused" and "metrics unreadable" in state["reason"]
    assert await h.weights() == {"2": 95, "3": 5}


async def test_canary_not_ready_rolls_back_on_the_next_tick(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    h.triton.ready["3"] = False
    await h.interval(canary=(100, 0, 0.004), seconds=0.5)
    state = await h.state()
    assert state["state"] == "rolled_back" and "not READY" in state["reason"]
    assert await h.weights() == {"2": 100}


async def test_canary_connection_errors_roll_back_at_once(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    h.recorder.upstream_error("qc", "3", "VersionUnavailable")
    await h.interval(canary=(100, 0, 0.004), seconds=0.5)
    assert (await h.state())["state"] == "rolled_back"


async def test_a_manual_weight_change_pauses_the_rollout(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    await h.policies.set_weights("qc", {"2": 50, "3": 50}, None, EventDraft("bob", "set_weights"))
    await h.interval(canary=(100, 0, 0.004))
    state = await h.state()
    assert state["state"] == "paused" and "bob" in state["reason"]
    assert await h.weights() == {"2": 50, "3": 50}, "the SRE's weights are kept"
    await h.controller.command("qc", "resume", "bob")
    assert await h.weights() == {"2": 95, "3": 5}


async def test_commands_and_one_active_rollout_per_model(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    with pytest.raises(Conflict, match="already has an active rollout"):
        await h.controller.begin("qc", SPEC, "alice")
    await h.controller.command("qc", "promote", "alice")
    assert (await h.weights())["3"] == 20
    await h.controller.command("qc", "abort", "alice")
    assert (await h.state())["state"] == "aborted" and await h.weights() == {"2": 100}
    with pytest.raises(Conflict):
        await h.controller.command("qc", "resume", "alice")
    await h.controller.begin("qc", SPEC, "alice")  # a new rollout after the old one ended
    assert (await h.state())["state"] == "progressing"


async def test_canary_must_be_ready_to_start(h: Harness) -> None:
    h.triton.ready["3"] = False
    with pytest.raises(Conflict, match="version 3"):
        await h.controller.begin("qc", SPEC, "alice")
    assert await h.store.get_rollout("qc") is None and await h.weights() == {"2": 100}


async def test_state_lives_in_the_store_so_a_new_controller_carries_on(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    await h.interval(canary=(100, 0, 0.004))
    fresh = h.new_controller()
    h.controller = fresh
    await h.interval(canary=(100, 0, 0.004))
    assert (await h.state())["step"] == 2 and (await h.weights())["3"] == 50


class FakeLifecycle:
    def __init__(self, serving: set[str]) -> None:
        self.loaded = set(serving)
        self.unloaded: list[str] = []
        self.reloads: list[list[str]] = []  # the versions each reload of Triton unloaded

    async def serving(self, model: str) -> set[str]:
        return set(self.loaded)

    async def unload(self, model: str, version: str, actor: str) -> dict[str, Any]:
        await self.unload_versions(model, [version], actor)
        return {}

    async def unload_versions(self, model: str, versions: list[str], actor: str) -> tuple[dict[str, str], str]:
        self.unloaded.extend(versions)
        self.loaded.difference_update(versions)
        self.reloads.append(list(versions))
        return {version: "idle" for version in versions}, ""


@pytest.mark.parametrize(("keep", "unloaded"), [(0, ["2", "1"]), (1, ["1"]), (2, [])])
async def test_promotion_cleanup_keeps_the_newest_previous_versions(h: Harness, keep: int,
                                                                   unloaded: list[str]) -> None:
    import asyncio

    lifecycle = FakeLifecycle({"1", "2", "3"})
    h.controller = h.new_controller(lifecycle=lifecycle)
    spec = RolloutSpec.model_validate({**SPEC.model_dump(), "steps": [50, 100], "unload_previous": True,
                                       "keep_previous": keep})
    await h.controller.begin("qc", spec, "alice")
    for _ in range(2):
        await h.interval(canary=(100, 0, 0.004))
    assert (await h.state())["state"] == "promoted"
    for _ in range(5):
        await asyncio.sleep(0)
    assert lifecycle.unloaded == unloaded
    assert lifecycle.reloads == ([unloaded] if unloaded else []), "every previous version in one reload"


async def test_no_cleanup_without_unload_previous(h: Harness) -> None:
    lifecycle = FakeLifecycle({"1", "2", "3"})
    h.controller = h.new_controller(lifecycle=lifecycle)
    await h.controller.begin("qc", RolloutSpec.model_validate({**SPEC.model_dump(), "steps": [100]}), "alice")
    await h.interval(canary=(100, 0, 0.004))
    assert (await h.state())["state"] == "promoted" and lifecycle.unloaded == []


async def test_a_refused_begin_leaves_no_rollout_record_behind(h: Harness) -> None:
    from gateway.errors import StaleRevision

    with_rule = PolicySpec.model_validate({"weights": {"2": 100},
                                           "rules": [{"header": "x-qa", "equals": "1", "version": "1"}]})
    await h.policies.put("qc", with_rule, None, EventDraft("sre", "put"))
    h.triton.ready["1"] = False  # the rule's version went away: the rollout's policy write is refused
    with pytest.raises(Conflict, match="version 1"):
        await h.controller.begin("qc", SPEC, "alice")
    assert await h.store.get_rollout("qc") is None, "no orphan record blocks the retry"
    h.triton.ready["1"] = True

    real_put = h.store.put_policy

    async def someone_else_first(*args: Any, **kwargs: Any) -> Any:
        h.store.put_policy = real_put  # type: ignore[method-assign]
        await real_put("qc", with_rule, None, EventDraft("bob", "put"))  # lands between our read and our write
        return await real_put(*args, **kwargs)

    h.store.put_policy = someone_else_first  # type: ignore[method-assign]
    with pytest.raises(StaleRevision):
        await h.controller.begin("qc", SPEC, "alice")
    assert await h.store.get_rollout("qc") is None
    rollout = await h.controller.begin("qc", SPEC, "alice")  # and the retry goes ahead
    assert rollout.phase.value == "progressing" and await h.weights() == {"2": 95, "3": 5}
    await h.controller.command("qc", "abort", "alice")
    h.triton.ready["1"] = False
    with pytest.raises(Conflict):
        await h.controller.begin("qc", SPEC, "alice")
    stored = await h.store.get_rollout("qc")
    assert stored is not None and stored.document["state"] == "aborted", "the earlier record is put back as it was"


async def test_an_unreadable_rollout_record_does_not_stop_the_others(h: Harness) -> None:
    await h.controller.begin("qc", SPEC, "alice")
    await h.store.put_rollout("tok", {"model": "tok", "state": "progressing"}, 0)  # half a record
    qc = await h.store.get_rollout("qc")
    assert qc is not None
    newer = {**qc.document, "spec": {**qc.document["spec"], "canary_budget": 3}}  # a newer version's field
    await h.store.put_rollout("qc", newer, qc.revision)
    await h.interval(canary=(100, 0, 0.004))
    assert (await h.weights())["3"] == 20, "qc's rollout went on beside the unreadable one"


async def test_a_refusing_rollback_gate_rolls_back_and_a_hold_gate_holds(h: Harness) -> None:
    with HookReceiver() as receiver:
        receiver.answers["/no"] = [503]
        gated = SPEC.model_copy(update={"gates": RolloutSpec.model_validate({"canary": "3", "gates": [
            {"url": receiver.url("/no"), "at": "each_step", "on_failure": "hold"}]}).gates})
        await h.controller.begin("qc", gated, "alice")
        for _ in range(2):  # held, and asked again on the next interval
            await h.interval(canary=(100, 0, 0.004))
            state = await h.state()
            assert (state["state"], state["step"], await h.weights()) == ("progressing", 0, {"2": 95, "3": 5})
            assert "held at step 1: the each_step gate" in state["reason"] and "answered 503" in state["reason"]
        assert len(receiver.bodies("/no")) == 2
        await h.controller.command("qc", "abort", "alice")

        rolling = SPEC.model_copy(update={"gates": RolloutSpec.model_validate({"canary": "3", "gates": [
            {"url": receiver.url("/no"), "at": "each_step", "on_failure": "rollback"}]}).gates})
        await h.controller.begin("qc", rolling, "alice")
        await h.interval(canary=(100, 0, 0.004))
        state = await h.state()
        assert state["state"] == "rolled_back" and await h.weights() == {"2": 100}
        assert "each_step gate" in state["reason"] and h.recorder.rollbacks == {("qc", "gate"): 1}
        await h.controller.stop()


async def test_webhooks_get_each_transition_once(h: Harness) -> None:
    with HookReceiver() as receiver:
        hooked = SPEC.model_copy(update={"webhooks": RolloutSpec.model_validate(
            {"canary": "3", "webhooks": [{"url": receiver.url("/hook")}]}).webhooks})
        await h.controller.begin("qc", hooked, "alice")
        await h.interval(canary=(100, 0, 0.004))  # healthy: step 2
        await h.interval(canary=(100, 0, 0.004), seconds=5)  # not due: nothing
        for command in ("pause", "resume", "promote", "abort"):
            await h.controller.command("qc", command, "alice")
        await h.interval(canary=(100, 0, 0.004))  # settled: nothing more
        await h.stop_after_webhooks(6)
    events = [(b["event"], b["step"], b["state"]) for b in receiver.bodies("/hook")]
    assert events == [("started", 1, "progressing"), ("step", 2, "progressing"), ("paused", 2, "paused"),
                      ("resumed", 2, "progressing"), ("step", 3, "progressing"), ("aborted", 3, "aborted")]
    assert (await h.state())["hooks"]["delivered"] == 6


class Unreachable:
    name = "t1:8000"
    reads = ServerReads()


async def test_a_triton_whose_statistics_cannot_be_read_leaves_the_verdict_as_before_saying_so(h: Harness) -> None:
    """Issue 34: the verdicts and the promotion are the gateway's view alone, each verdict says
    that Triton's own view is missing and why, and the rollout goes on."""
    async def refused(*args: Any, **kwargs: Any) -> tuple[int, Any]:
        raise UpstreamUnavailable("gateway: cannot connect to Triton")

    h.triton.servers_of = lambda key: [Unreachable()]  # type: ignore[method-assign]
    h.triton.call_on = refused  # type: ignore[attr-defined]
    await h.controller.begin("qc", SPEC, "alice")
    for _ in range(4):
        await h.interval(canary=(100, 0, 0.004))
    state = await h.state()
    assert state["state"] == "promoted"
    assert state["likeness"]["words"].startswith("configs not compared (2: t1:8000: /v2/models/qc/config failed")
    assert all(v["outcome"] == "healthy" for v in state["verdicts"])
    assert all("Triton's statistics unreadable (t1:8000: /v2/models/qc/stats failed: gateway: cannot connect to "
               "Triton): judged on the gateway's view only" in v["reason"] for v in state["verdicts"])


WARMING = SPEC.model_copy(update={"warmup": WarmupSpec(percent=50, window_s=2, windows=2, min_requests=10, max_s=30)})


async def shadow_of(h: Harness) -> dict[str, Any] | None:
    stored = await h.store.get_policy("qc")
    assert stored is not None and stored.spec is not None
    shadow = stored.spec.shadow
    return None if shadow is None else {"version": shadow.version, "percent": int(shadow.percent)}


async def test_a_paused_warm_up_takes_its_mirror_off_and_only_a_resumed_warm_up_puts_it_back(h: Harness) -> None:
    own = {"version": "1", "percent": 5}
    await h.policies.put("qc", PolicySpec.model_validate({"weights": {"2": 100}, "shadow": own}), 1,
                         EventDraft("sre", "put"))
    mirror = {"version": "3", "percent": 50}
    await h.controller.begin("qc", WARMING, "alice")
    assert await shadow_of(h) == mirror and await h.weights() == {"2": 100}
    await h.controller.command("qc", "pause", "bob")  # paused while warming: the policy's own shadow is back
    assert await shadow_of(h) == own and await h.weights() == {"2": 100}
    await h.interval(canary=(0, 0, 0.004), seconds=40)  # a paused rollout's tick changes nothing
    assert (await h.state())["state"] == "paused" and await shadow_of(h) == own
    await h.controller.command("qc", "resume", "bob")  # the warm-up resumes, and its mirror with it
    assert (await h.state())["warmup"]["state"] == "warming" and await shadow_of(h) == mirror
    await h.interval(canary=(0, 0, 0.004), seconds=40)  # past max_s with no mirrored answers: on_timeout pause
    state = await h.state()
    assert (state["state"], state["warmup"]["state"]) == ("paused", "timed_out")
    assert await shadow_of(h) == own and await h.weights() == {"2": 100}, "the timed-out warm-up's mirror stayed"
    await h.controller.command("qc", "resume", "bob")  # step 1 anyway: weight, and no mirror
    assert await shadow_of(h) == own and await h.weights() == {"2": 95, "3": 5}


async def test_a_paused_warm_ups_mirror_comes_off_on_a_later_tick_and_a_humans_policy_stays(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    mirror = {"version": "3", "percent": 50}
    await h.controller.begin("qc", WARMING, "alice")
    put_policy = h.store.put_policy

    async def store_down(*args: Any, **kwargs: Any) -> Any:
        raise StoreError("store down")
    monkeypatch.setattr(h.store, "put_policy", store_down)
    with pytest.raises(StoreError):
        await h.controller.command("qc", "pause", "bob")  # the pause is stored, its policy write is not
    assert (await h.state())["state"] == "paused" and await shadow_of(h) == mirror
    monkeypatch.setattr(h.store, "put_policy", put_policy)
    await h.interval(canary=(0, 0, 0.004), seconds=1)
    assert await shadow_of(h) is None and await h.weights() == {"2": 100}
    await h.controller.command("qc", "resume", "bob")
    assert await shadow_of(h) == mirror
    await h.policies.set_weights("qc", {"2": 90, "1": 10}, None, EventDraft("carol", "set_weights"))
    await h.interval(canary=(0, 0, 0.004), seconds=1)  # a human's change while warming: paused, theirs stands
    assert (await h.state())["state"] == "paused"
    assert await shadow_of(h) == mirror and await h.weights() == {"2": 90, "1": 10}
