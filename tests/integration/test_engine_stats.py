"""Triton's own statistics of a version, read from the real Triton as interval deltas
(services/engine_stats.py), with the sample models that make them differ: ``batched`` (dynamic
batching; version 3 sleeps 20 ms in compute) and ``cached`` (the response cache on)."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator

import pytest

from gateway.devtools.local_triton import LocalTriton, free_port
from gateway.fleet.balancer import Fleet
from gateway.fleet.config import ServerSpec
from gateway.grpc.upstream import GrpcUpstream
from gateway.rollout.attribution import COMPUTE, attribute, view
from gateway.services.engine_stats import EngineStats, interval
from gateway.services.triton_control import TritonControl
from tests.support import wait_for

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def engine_triton() -> Iterator[LocalTriton]:
    """A Triton of its own: loading the sample models `batched` and `cached` on the session one
    would change what every later module finds there."""
    with LocalTriton.on_free_ports(models=("batched", "cached")) as server:
        warmed = (("batched", "2"), ("batched", "3"), ("cached", "1"))
        for model, version in warmed:
            infer(server, model, version, value=-1.0)  # a Python model's first execution is slow: not measured
        # Triton counts a request's success after its answer is sent (its cache miss before it): a test
        # reading its `before` at once could take the warm-up's success for one of its own (a full run on
        # 985abea: cached's 10 requests read as 11 successes and 10 lookups).
        wait_for(lambda: all(successes(server, model, version) == 1 for model, version in warmed), 10,
                 interval=0.02, what="Triton to count the warm-up requests")
        yield server


@pytest.fixture
async def stats(engine_triton: LocalTriton) -> AsyncIterator[EngineStats]:
    fleet = Fleet("default", grpc_connect=GrpcUpstream)
    fleet.add(ServerSpec(http=engine_triton.http_url, grpc=engine_triton.grpc_url))
    fleet.add(ServerSpec(http=f"http://127.0.0.1:{free_port()}", grpc="127.0.0.1:1"))  # nobody listens there
    yield EngineStats(TritonControl(fleet), timeout_s=2.0)
    await fleet.aclose()


def successes(server: LocalTriton, model: str, version: str) -> int:
    """The successes Triton has counted for a version, read from its statistics endpoint."""
    with urllib.request.urlopen(f"{server.http_url}/v2/models/{model}/versions/{version}/stats", timeout=10) as answer:
        return int(json.load(answer)["model_stats"][0]["inference_stats"]["success"]["count"])


def infer(server: LocalTriton, model: str, version: str, value: float = 1.0) -> int:
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4],
                                   "data": [value, 2, 3, 4]}]}).encode()
    request = urllib.request.Request(f"{server.http_url}/v2/models/{model}/versions/{version}/infer", data=body,
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


async def test_a_version_slower_in_compute_reads_as_compute(engine_triton: LocalTriton, stats: EngineStats) -> None:
    before = await stats.read("batched", ["2", "3"])
    # one client per version, both at once: each version's requests wait in its queue only for the
    # batcher's 2 ms. With several clients on version 3 its queue time is the wait behind its own 20 ms
    # batches, and on a starved machine one stalled batch made its mean queue three times the
    # compute difference (62 vs 21 ms, ci-7): "a slower model queues more too" is
    # tests/unit/test_attribution.py's case; this one reads what the real Triton counts.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(lambda v: [infer(engine_triton, "batched", v) for _ in range(20)], version)
                for version in ("2", "3")]
        codes = [code for run in runs for code in run.result()]
    assert codes.count(200) == 40
    after = await stats.read("batched", ["2", "3"])
    canary, stable = interval(before, after, "batched", "3"), interval(before, after, "batched", "2")
    assert canary.counters is not None and stable.counters is not None
    assert (canary.counters.success, stable.counters.success) == (20, 20)
    slow, fast = view(canary.counters), view(stable.counters)
    assert slow.compute_ms is not None and fast.compute_ms is not None
    assert slow.compute_ms - fast.compute_ms > 15  # the 20 ms the config's compute_ms gives version 3
    assert slow.batch is not None and slow.batch >= 1.0
    found = attribute(canary, stable, [0.025] * 20, [0.002] * 20, floor=0.2)
    assert found.cause == COMPUTE
    # the second server of the fleet does not answer: named, with why, and left out of the sum
    assert canary.servers == (engine_triton.http_url.removeprefix("http://"),)
    assert len(canary.missing) == 1 and "/v2/models/batched/stats failed" in canary.missing[0]
    assert "statistics missing from" in found.summary


async def test_cache_hits_are_counted_apart(engine_triton: LocalTriton, stats: EngineStats) -> None:
    before = await stats.read("cached", ["1"])
    counted = successes(engine_triton, "cached", "1")
    for _ in range(10):
        assert infer(engine_triton, "cached", "1", value=7.0) == 200  # one input: one miss, then hits
    wait_for(lambda: successes(engine_triton, "cached", "1") >= counted + 10, 10, interval=0.02,
             what="Triton to count the last success (after its answer)")
    after = await stats.read("cached", ["1"])
    found = interval(before, after, "cached", "1")
    assert found.counters is not None
    seen = view(found.counters)
    assert (seen.cache_hits + seen.cache_misses, found.counters.success) == (10, 10)
    assert (seen.cache_hits, seen.cache_misses, found.counters.compute_count) == (9, 1, 1)  # hits run no compute


async def test_a_model_triton_does_not_know_is_unreadable_not_an_error(stats: EngineStats) -> None:
    found = await stats.read("nope", ["1"])
    assert found.counters == {}
    assert len(found.unreadable) == 2
    assert any("400" in why for why in found.unreadable.values())
