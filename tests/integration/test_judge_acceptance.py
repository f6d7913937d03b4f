"""Issue 16's acceptance for the statistical judge, on the real Triton through the real gateway:
an identical canary at ~150 req/s is promoted within 2 minutes, one 30% slower is rolled back
within 2 minutes, and the thresholds judge does not roll that same slower canary back.

The canary (version 3) is judged against a baseline (version 1, the same code as the stable,
version 2) that takes as much traffic as it does: on Triton's Python backend a version's latency
depends on its share. The bare sample model is ~0.15 ms of Python inside Triton, and a version
taking 5% of 150 req/s measured 4-34% slower per 3 s interval (+9% to +30% pooled, in phases of
30-60 s) than the same code taking 95%, in Triton's own compute_infer statistics as much as on
the gateway's clock, for either version: a version that serves a request every ~130 ms runs each
one colder than one that serves every ~7 ms. Judged against the stable, the identical canary was
rolled back in 2 of 3 runs (the judge was right: it *was* slower); against a baseline at the same
share the difference measured +3-4% (bench/canary_share.py --baseline; README, "The statistical
judge").

``JUDGE_ACCEPTANCE_RUNS=3`` repeats the identical-canary run (the issue asks for 3 in a row);
the suite runs it once. ``JUDGE_ACCEPTANCE_BASE_DELAY_MS`` gives every version that much work
per request (default 0, the bare model). Each test prints its time to promotion or rollback and
the load average.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.devtools.local_triton import LocalTriton
from gateway.upstream import HttpUpstream
from tests.conftest import Faults
from tests.support import INFER_BODY, TOKEN, GatewayThread, LoadThread, admin_call, gateway_settings, wait_for

pytestmark = pytest.mark.triton

RATE = 150.0  # req/s, the "~150 req/s"
# everything else: the statistical judge's defaults
INTERVAL_S = 3
SPEC = {"steps": [5, 20, 50, 100], "interval_s": INTERVAL_S, "baseline": "1"}
DEADLINE_S = 120.0  # "within 2 minutes"
BASE_DELAY_MS = float(os.environ.get("JUDGE_ACCEPTANCE_BASE_DELAY_MS", "0"))  # 0: the bare sub-ms model
SLOWER = 0.30
RUNS = int(os.environ.get("JUDGE_ACCEPTANCE_RUNS", "1"))
THRESHOLDS_S = 5 * INTERVAL_S  # how long the thresholds judge is shown not to roll the slower canary back


class PacedLoad(LoadThread):
    """Inference traffic at a fixed rate from a thread: ``workers`` clients, each sending on its
    own schedule (a late answer makes it catch up, never send more than the rate)."""

    def __init__(self, url: str, rate: float, workers: int = 8) -> None:
        super().__init__()
        self.url, self.rate, self.workers = url, rate, workers
        self.statuses: Counter[int] = Counter()
        self.versions: Counter[str] = Counter()
        self.started = self.seconds = 0.0

    async def _run(self) -> None:
        client = HttpUpstream(self.url, max_connections=self.workers, request_timeout_s=30)
        period = self.workers / self.rate
        started = self.started = time.monotonic()

        async def worker(index: int) -> None:
            due = started + index * period / self.workers
            while not self._stop.is_set():
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                due += period
                try:
                    response = await client.request(b"POST", b"/v2/models/qc/infer", [], INFER_BODY)
                    payload = await response.read()
                except Exception:  # counted: the test asserts there are none
                    self.statuses[0] += 1
                    continue
                self.statuses[response.status] += 1
                if response.status == 200:
                    self.versions[json.loads(payload)["model_version"]] += 1

        await asyncio.gather(*(worker(index) for index in range(self.workers)))
        self.seconds = time.monotonic() - started
        await client.aclose()

    @property
    def achieved(self) -> float:
        """Requests per second so far (while running) or over the whole run."""
        seconds = self.seconds or time.monotonic() - self.started
        return sum(self.statuses.values()) / seconds if self.started else 0.0


@pytest.fixture
def gateway(triton: LocalTriton, faults: Faults) -> Iterator[GatewayThread]:
    """A gateway with its default controller tick, stable version 2; every version does BASE_DELAY_MS of work."""
    for version in ("1", "2", "3"):
        faults.set("qc", version, delay_ms=BASE_DELAY_MS)
    settings = gateway_settings(triton.http_url, admin_token=TOKEN, policies={"qc": {"weights": {"2": 100}}})
    with GatewayThread(settings) as running:
        yield running


def start(url: str, **spec: Any) -> float:
    status, doc = admin_call(url, "POST", "/admin/models/qc/rollout", {"canary": "3", **SPEC, **spec})
    assert status == 200, doc
    return time.monotonic()


def finished(url: str) -> dict[str, Any] | None:
    status, doc = admin_call(url, "GET", "/admin/models/qc/rollout")
    assert status == 200, doc
    return doc if doc["state"] != "progressing" else None


def outcome(load: PacedLoad, doc: dict[str, Any], took: float, what: str) -> None:
    assert set(load.statuses) == {200}, load.statuses
    assert 0.8 * RATE <= load.achieved <= 1.1 * RATE, f"{load.achieved:.0f} req/s, not ~{RATE:.0f}"
    load_average = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"\n{what}: {doc['state']} after {took:.1f} s at {load.achieved:.0f} req/s (load average {load_average}); "
          f"{doc['reason']}")


def baseline_median_s(gateway: GatewayThread, seconds: float = 9.0) -> float:
    """The baseline's median latency on the gateway's own clock (the one the judge reads), at
    the share it will have at the first step."""
    recorder = gateway.app.recorder
    status, doc = admin_call(gateway.url, "PUT", "/admin/models/qc/policy", {"weights": {"2": 95, "1": 5}})
    assert status == 200, doc

    async def watch() -> None:
        recorder.watch_latencies("qc", "1")
        recorder.take_latencies("qc", "1")

    async def take() -> list[float]:
        sample = recorder.take_latencies("qc", "1")
        recorder.unwatch_latencies("qc", "1")
        return sample

    time.sleep(2)  # past the first requests of a version that just started taking traffic
    gateway.call(watch())
    time.sleep(seconds)
    sample: list[float] = gateway.call(take())
    assert len(sample) >= 40, len(sample)
    return statistics.median(sample)


@pytest.mark.parametrize("run", range(RUNS))
def test_a_canary_identical_to_the_stable_is_promoted_within_2_minutes(gateway: GatewayThread, run: int) -> None:
    """Over 30 s: the statistical judge at its defaults (3 s intervals, steps to 100%) needs ~40-50 s of 150
    req/s to promote; the issue's bound is 2 minutes."""
    with PacedLoad(gateway.url, RATE) as load:
        time.sleep(1)  # the load at its rate before the rollout starts
        started = start(gateway.url)
        doc = wait_for(lambda: finished(gateway.url), DEADLINE_S, interval=0.25, what="the rollout to end")
        took = time.monotonic() - started
    outcome(load, doc, took, f"identical canary, run {run + 1} of {RUNS}")
    assert doc["state"] == "promoted", doc["reason"]
    assert load.versions["3"] > 0 and load.versions["2"] > 0 and load.versions["1"] > 0
    latency = {m["name"]: m for m in doc["verdicts"][-1]["metrics"]}["latency"]
    print(latency["summary"])
    assert latency["verdict"] == "pass", latency["summary"]


def slower_canary(gateway: GatewayThread, faults: Faults) -> float:
    """Make version 3 SLOWER end to end: its delay is the base one plus 30% of the baseline's
    median at 5%, so (baseline median + extra) / baseline median = 1.3 on the gateway's clock."""
    median = baseline_median_s(gateway)
    extra_ms = SLOWER * median * 1000
    faults.set("qc", "3", delay_ms=BASE_DELAY_MS + extra_ms)
    print(f"\nbaseline median {median * 1000:.3f} ms: canary delay {BASE_DELAY_MS + extra_ms:.3f} ms")
    return median


def test_a_canary_30_percent_slower_is_rolled_back_and_the_thresholds_judge_would_not_be(
        gateway: GatewayThread, faults: Faults) -> None:
    """Then the same canary under `judge: thresholds` (its `max_p99_ratio` is 1.5) for
    THRESHOLDS_S: not rolled back. At ~22 canary requests per 3 s interval it has no verdict at
    all (`min_requests` 50), so it would hold the canary at 5% for good; 5 intervals show that as
    well as the ~37 s the statistical judge takes (which this phase used to wait). (Lowered to
    10, it judged p99s of ~22 requests, in effect their maximum: once it rolled this canary back
    on a 70.8 ms vs 35.0 ms p99 from CPU contention, a false alarm an identical canary gets too.)"""
    with PacedLoad(gateway.url, RATE) as load:
        slower_canary(gateway, faults)
        started = start(gateway.url)
        doc = wait_for(lambda: finished(gateway.url), DEADLINE_S, interval=0.25, what="the rollout to end")
        took = time.monotonic() - started
        outcome(load, doc, took, "30% slower canary, statistical judge")
        assert doc["state"] == "rolled_back" and "latency worse" in doc["reason"], doc["reason"]
        failed = {m["name"]: m for m in doc["verdicts"][-1]["metrics"]}["latency"]
        assert failed["verdict"] == "fail" and failed["effect"] > doc["spec"]["max_latency_increase"], failed
        assert failed["e_value"] >= failed["e_threshold"]

        # against the stable: the thresholds judge takes no baseline (422)
        start(gateway.url, judge="thresholds", max_p99_ratio=1.5, retry=True, baseline=None)
        time.sleep(THRESHOLDS_S)
        status, doc = admin_call(gateway.url, "GET", "/admin/models/qc/rollout")
    assert status == 200, doc
    outcome(load, doc, THRESHOLDS_S, "the same canary, thresholds judge")
    assert doc["state"] == "progressing" and doc["step"] == 0, doc["reason"]
    assert doc["verdicts"] and all(v["outcome"] == "inconclusive" for v in doc["verdicts"]), doc["verdicts"]
