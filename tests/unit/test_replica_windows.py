"""Replicas' published windows (gateway.services.replica_windows): each second sent once (the
current one as far as it got, then its growth), across clocks, and summed exactly."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from gateway.app import Gateway
from gateway.services.replica_windows import SETTLE_S, FleetView, ReplicaWindows, WindowTap, decode, encode
from gateway.settings import Settings
from gateway.store.memory import InMemoryStore
from gateway.telemetry.recorder import Outcome, Recorder


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def record(recorder: Recorder, version: str, count: int, outcome: Outcome = Outcome.SUCCESS) -> None:
    code = "200" if outcome is Outcome.SUCCESS else "500"
    for _ in range(count):
        recorder.record("qc", version, outcome, 0.004, "weighted", "http", code)


@pytest.fixture
def clocks() -> tuple[Clock, Clock]:
    return Clock(1000.2), Clock(5000.2)  # two processes' monotonic clocks, 4000 s apart


def test_two_replicas_windows_sum_exactly_whatever_their_clocks(clocks: tuple[Clock, Clock]) -> None:
    a_clock, b_clock = clocks
    a, b = Recorder(clock=a_clock), Recorder(clock=b_clock)
    taps = WindowTap(a), WindowTap(b)
    versions = {("qc", "2"), ("qc", "3")}
    view = FleetView()
    view._clock = Clock(9000.2)  # the holder's own clock
    offsets = {"a": 100_000.0 - 1000.0, "b": 100_000.0 - 5000.0}  # both clocks read the same wall time
    holder_offset = 100_000.0 - 9000.0
    for step in range(5):
        record(a, "3", 3, Outcome.UPSTREAM_ERROR if step == 2 else Outcome.SUCCESS)
        record(b, "3", 2)
        record(a, "2", 10)
        if step == 3:
            record(b, "3", 1, Outcome.REJECTED)  # Triton's queue refused it: judged apart
        for name, tap in zip(("a", "b"), taps):
            text = encode(tap.take(versions), name, offsets[name])
            json.loads(text)  # JSON: no pickle from the store
            view.add(*decode(text, holder_offset))
        record(b, "3", 1)  # later in the same second: its growth goes with the next take
        for clock in (a_clock, b_clock, view._clock):
            clock.now += 1
    for name, tap in zip(("a", "b"), taps):
        view.add(*decode(encode(tap.take(versions), name, offsets[name]), holder_offset))
    canary, stable = view.window("qc", "3", 10), view.window("qc", "2", 10)
    assert (canary.requests, canary.errors) == (5 * 3 + 5 * 2 + 5 * 1, 3)
    assert canary.rejected == 1 and stable.rejected == 0
    assert stable.requests == 50 and sum(canary.histogram) == canary.requests
    assert canary.histogram.index(canary.requests) == stable.histogram.index(50), "4 ms, in one bucket"
    assert view.reporters(10) == ["a", "b"]


def test_watched_versions_send_their_samples_and_clients_once(clocks: tuple[Clock, Clock]) -> None:
    recorder = Recorder(clock=clocks[0])
    recorder.watch_latencies("qc", "3")
    for client in ("10.0.0.1", "10.0.0.2", "10.0.0.1"):
        recorder.record("qc", "3", Outcome.SUCCESS, 0.004, "weighted", "http", "200", client=client)
    tap = WindowTap(recorder)
    delta = tap.take({("qc", "3")})
    assert delta.samples[("qc", "3")][0] == 3 and delta.clients[("qc", "3")]["10.0.0.1"][0] == 2
    again = tap.take({("qc", "3")})
    assert not again.samples and not again.clients, "taken: the judge reads each once"
    view = FleetView()
    view.add("a", decode(encode(delta, "a", 0.0), 0.0)[1])
    assert len(view.take_latencies("qc", "3")) == 3 and view.take_clients("qc", "3") == {
        "10.0.0.1": (2, 0, 0, 0), "10.0.0.2": (1, 0, 0, 0)}


def test_a_report_that_is_not_one_is_refused() -> None:
    with pytest.raises((ValueError, KeyError, TypeError)):
        decode('{"replica": "a", "offset": 0, "seconds": [["qc"]]}', 0.0)


def test_a_seconds_late_requests_are_sent_until_it_settles() -> None:
    """With --workers a second's last requests reach the control plane's recorder up to a report
    after the second ended: its growth is sent at the next takes, each request once."""
    clock = Clock(1000.2)
    recorder = Recorder(clock=clock)
    tap, view = WindowTap(recorder), FleetView()
    view._clock = Clock(1000.2)
    record(recorder, "3", 4)
    view.add("a", tap.take({("qc", "3")}))
    second = int(clock.now)
    clock.now += 1
    view._clock.now += 1
    record(recorder, "3", 1)  # this second's
    counted = recorder.second_counts("qc", "3", second)
    assert counted is not None
    view.add("a", tap.take({("qc", "3")}))  # the second before as a whole, as far as it got
    series = recorder._series[("qc", "3")]
    series.requests[second % recorder._slots] += 2  # two more of it, arriving late (a worker's report)
    for _ in range(SETTLE_S + 1):
        clock.now += 1
        view._clock.now += 1
        view.add("a", tap.take({("qc", "3")}))
    assert view.window("qc", "3", 10).requests == 4 + 2 + 1


def test_only_the_recorder_source_publishes_windows() -> None:
    """With metrics_source: prometheus nothing changes: no windows published, the judge reads
    Prometheus (which sums every replica already)."""
    base = {"triton_url": "http://127.0.0.1:9", "store_url": "memory://"}
    assert Gateway(Settings.load(None, **base)).windows is not None
    app = Gateway(Settings.load(None, metrics_source="prometheus", prometheus_url="http://127.0.0.1:9", **base))
    assert app.windows is None and app.rollouts.windows is None
    assert app.rollouts.judged is app.recorder and app.rollouts.judged_source() is app.source


class SlowStore(InMemoryStore):
    """The store as a replica sees it: a write lands while other work goes on."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def publish_windows(self, replica: str, payload: str, keep_s: float) -> None:
        await self.release.wait()
        await super().publish_windows(replica, payload, keep_s)


async def test_the_holders_own_windows_count_once_however_its_writes_and_reads_interleave() -> None:
    store, recorder = SlowStore(), Recorder()
    windows = ReplicaWindows(store, recorder, "a")
    windows._versions, windows._looked = {("qc", "3")}, time.monotonic()  # as if a rollout of qc 3 were active
    record(recorder, "3", 5)
    landing = asyncio.create_task(windows.publish())  # taken before it holds; written after it caught up
    await asyncio.sleep(0)
    await windows.refresh()  # caught up with an empty store: from now on its own go straight in
    store.release.set()
    await landing
    record(recorder, "3", 2)
    await windows.refresh()  # publishes the 2 at once (and does not read them again), reads the 5
    assert windows.view.window("qc", "3", 10).requests == 7
    await windows.refresh()
    assert windows.view.window("qc", "3", 10).requests == 7 and windows.published == 2
