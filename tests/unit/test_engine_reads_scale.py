"""What Triton's own view of a rollout's versions costs per interval at real size: counted, never
timed (issue 34 within issue 36's bound). Each interval of each rollout reads its model's
statistics and configuration once per server, whatever the size of the repository, and no
repository index of its own.

Against :class:`tests.scale_triton.ScaleTriton` (see its docstring for why not the real Triton),
with the controller built on the real model control, store and policy service (the app's other
loops are not what is counted here).
"""

from __future__ import annotations

import pytest

from gateway.fleet.balancer import Fleet
from gateway.fleet.config import ServerSpec
from gateway.grpc.upstream import GrpcUpstream
from gateway.policy import PolicySpec
from gateway.policy_book import PolicyBook
from gateway.rollout.controller import RolloutController
from gateway.rollout.spec import RolloutSpec
from gateway.services.policies import PolicyService
from gateway.services.triton_control import TritonControl
from gateway.store.base import EventDraft
from gateway.store.memory import InMemoryStore
from gateway.telemetry.recorder import Recorder
from gateway.telemetry.sources import RecorderSource
from tests.scale_triton import ScaleTriton, names
from tests.unit.test_triton_reads_scale import Clock

ROLLOUTS = 20
INTERVALS = 3


@pytest.mark.parametrize("models", [500, 5000])
async def test_each_interval_reads_only_the_rollouts_models_once_per_server(models: int) -> None:
    async with ScaleTriton(models) as triton:
        fleet = Fleet("default", grpc_connect=GrpcUpstream)
        server = fleet.add(ServerSpec(http=triton.url, grpc="127.0.0.1:1"))
        clock = Clock()
        server.reads.clock = clock
        control = TritonControl(fleet, share_s=1.0)
        store, recorder = InMemoryStore(), Recorder()
        policies = PolicyService(store, PolicyBook(), control)
        controller = RolloutController(store, control, policies, RecorderSource(recorder), recorder, clock=clock)
        rolled = names(models)[-ROLLOUTS:]
        try:
            for model in rolled:
                await policies.put(model, PolicySpec.model_validate({"weights": {"2": 100}}), 0,
                                   EventDraft("test", "put"))
                await controller.begin(model, RolloutSpec(canary="3", interval_s=10, steps=[50, 100]), "test")
            before, configs, index = dict(triton.stats_of), triton.asked["config"], triton.asked["index"]
            ticks = 0
            for _ in range(INTERVALS * 10 + 1):  # one-second ticks: three intervals and the last one's verdict
                await controller.tick()
                clock.now += 1.0
                ticks += 1
            read = {model: count - before.get(model, 0) for model, count in triton.stats_of.items()
                    if count != before.get(model, 0)}
            assert set(read) == set(rolled), "statistics of the rollouts' models only"
            assert all(count <= INTERVALS + 1 for count in read.values()), read  # one per interval (+ its first mark)
            assert triton.asked["config"] - configs <= ROLLOUTS * INTERVALS, "one config read per rollout per interval"
            assert triton.asked["index"] - index <= ticks, "no index read of its own"
            for model in rolled:  # and every interval was judged, with Triton's view in its verdict
                verdicts = (await controller.status(model))["verdicts"]
                assert len(verdicts) == INTERVALS and all(v["attribution"] is not None for v in verdicts), verdicts
        finally:
            await controller.stop()
            await fleet.aclose()
