"""What a tick and a policy PUT ask of Triton at real size: counted, never timed.

Before issue 36 every rollout's tick fetched Triton's whole repository index to keep one model's
entries (50 rollouts: 50 index reads a tick, 810 KB each at 5,000 models), and every policy PUT
read the whole index to check two versions' readiness. Now the controller, the fleet's health
check and the model-config reader share what they read of each server (``gateway.fleet.reads``:
at most one index read per server per tick), and a PUT asks each version's own readiness.

Against :class:`tests.scale_triton.ScaleTriton` (a real Triton cannot hold a repository this
size on these machines: see its docstring).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from gateway.app import Gateway
from gateway.devtools.local_triton import free_port
from gateway.rollout.spec import RolloutSpec
from gateway.settings import Settings
from gateway.store.memory import InMemoryStore
from tests.scale_triton import ScaleTriton, names
from tests.support import TOKEN

ROLLOUTS = 50


@asynccontextmanager
async def gateway(triton: ScaleTriton, **values: Any) -> AsyncIterator[Gateway]:
    settings = Settings.load(None, host="127.0.0.1", port=free_port(), triton_url=triton.url, admin_token=TOKEN,
                             grpc_enabled=False, controller_enabled=False, store_url="memory://",
                             fleet_health_interval_s=60, **values)
    app = Gateway(settings, store=InMemoryStore())
    async with app.running():
        yield app


async def put(app: Gateway, model: str, weights: dict[str, int]) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app.control), base_url="http://gateway") as client:
        return await client.put(f"/admin/models/{model}/policy", json={"weights": weights},
                                headers={"Authorization": f"Bearer {TOKEN}"})


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


async def start_rollouts(app: Gateway, count: int) -> tuple[list[str], Clock]:
    """``count`` rollouts (one interval an hour), the model-config reader stopped (it shares the
    same reads; here, only the ticks), and the fleet's reads on a clock the test moves."""
    await app.sequence_models.stop()
    models = names(count)
    for model in models:
        assert (await put(app, model, {"2": 100})).status_code == 200
        await app.rollouts.begin(model, RolloutSpec(canary="3", interval_s=3600), "test")
    clock = Clock()
    for server in app.fleets.default.servers.values():
        server.reads.clock = clock  # a tick's worth of time between ticks, however fast they run here
    return models, clock


async def test_fifty_rollouts_tick_on_at_most_one_index_read_per_server_per_tick() -> None:
    async with ScaleTriton(500) as triton, gateway(triton, controller_tick_s=1.0) as app:
        models, clock = await start_rollouts(app, ROLLOUTS)
        before, ticks = triton.asked["index"], 5
        for _ in range(ticks):
            await app.rollouts.tick()
            clock.now += 1.0
        reads = triton.asked["index"] - before
        assert reads <= ticks, f"{reads} repository index reads in {ticks} ticks of {ROLLOUTS} rollouts"
        assert all(app.recorder.rollout_states[model][0] == "progressing" for model in models)


async def test_a_policy_put_asks_triton_for_its_versions_readiness_only() -> None:
    async with ScaleTriton(5000) as triton, gateway(triton) as app:
        await app.sync.stop()  # the PUT's own calls (state sync's, on the change feed: test_state_sync_scale)
        await app.sequence_models.stop()  # and not the model-config reader's (it reads the index every 2 s)
        calls: dict[str, int] = {}
        for name in ("get_policy", "put_policy", "scan_policies", "list_policies"):
            method = getattr(app.store, name)

            async def counted(*args: Any, _name: str = name, _method: Any = method, **kwargs: Any) -> Any:
                calls[_name] = calls.get(_name, 0) + 1
                return await _method(*args, **kwargs)

            setattr(app.store, name, counted)
        asked = dict(triton.asked)
        for weights in ({"2": 90, "3": 10}, {"2": 80, "3": 20}):
            assert (await put(app, "m04999", weights)).status_code == 200
        during = {kind: count - asked.get(kind, 0) for kind, count in triton.asked.items() if count != asked.get(kind)}
        assert during == {"ready": 4}, "per PUT: each version's readiness (2 versions, 1 server), no index read"
        assert calls == {"put_policy": 2}, "per PUT: one compare-and-set, nothing listed"
        # a version that is not READY is still refused with Triton's own words for it
        refused = await put(app, "m04999", {"2": 90, "7": 10})
        assert refused.status_code == 409 and "version 7 of model 'm04999' is not known to Triton" in refused.text
