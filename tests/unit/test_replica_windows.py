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
from gateway.workers.deltas import Delta, MergedRecorder, MergedSample


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


def published(requests: int, ahead_s: int = 0, **fields: object) -> dict[str, object]:
    """A report as a replica of this version publishes it: ``requests`` of qc 3 in this second."""
    return {"replica": "a", "offset": time.time() - time.monotonic(), "seq": 1,
            "seconds": [["qc", "3", int(time.monotonic()) + ahead_s, requests, 0, 0, 0, 0, [[3, requests]]]],
            "samples": [["qc", "3", requests, [0.004] * requests]], "clients": [], "streams": [], **fields}


def _malformed() -> dict[str, str]:
    good = published(1)
    second = good["seconds"][0]  # type: ignore[index]
    return {
        "not an object": "[1, 2]",
        "offset Infinity": json.dumps({**good, "offset": float("inf")}),  # json.dumps writes Infinity
        "offset past float": json.dumps(good).replace('"offset":', '"offset": 1e400, "x":', 1),
        "clients a list": json.dumps({**good, "clients": [["qc", "3", [["10.0.0.1", [1, 0, 0, 0]]]]]}),
        "bucket out of range": json.dumps({**good, "seconds": [[*second[:8], [[10_000, 1]]]]}),
        "negative bucket": json.dumps({**good, "seconds": [[*second[:8], [[-1, 1]]]]}),
        "negative seen": json.dumps({**good, "samples": [["qc", "3", -5, [0.004]]]}),
        "negative count": json.dumps({**good, "seconds": [[*second[:3], -7, *second[4:]]]}),
        "a million samples of one": json.dumps({**good, "samples": [["qc", "3", 1, [0.004] * 1_000_000]]}),
        "NaN sample": json.dumps({**good, "samples": [["qc", "3", 1, [float("nan")]]]}),
        "a second in the future": json.dumps(published(1, ahead_s=300)),
        "a clock ahead": json.dumps({**good, "offset": good["offset"] + 300.0}),  # type: ignore[operator]
        "a second that is not a number": json.dumps({**good, "seconds": [[*second[:2], "now", *second[3:]]]}),
    }


@pytest.mark.parametrize("kind", list(_malformed()))
async def test_a_malformed_report_is_skipped_and_counted_and_the_rest_read_once(kind: str) -> None:
    """Another gateway version's report, a broken writer's or a clock ahead: that report alone is
    refused (counted, logged once); the reports around it are read, each once, and the ticks go on.
    On the code before, refresh raised (every tick, re-adding the reports before it) or took it in."""
    store = InMemoryStore()
    windows = ReplicaWindows(store, Recorder(), "holder")
    await windows.refresh()  # caught up with an empty store
    windows._direct.add(99)  # as if one of its own reports were in the view already (it looks for those first)
    await store.publish_windows("a", json.dumps(published(1)), 300)
    await store.publish_windows("holder", _malformed()[kind], 300)  # under the holder's own name
    await store.publish_windows("a", json.dumps(published(2)), 300)
    for _ in range(3):
        await windows.refresh()  # a tick each
    window = windows.view.window("qc", "3", 10)
    assert (window.requests, sum(window.histogram)) == (3, 3), "each good report once, the bad one not at all"
    latencies = windows.view.take_latencies("qc", "3")
    assert latencies == [0.004] * 3
    assert windows.view.reporters(10) == ["a"] and windows.refused == 1


def test_a_future_second_from_a_worker_does_not_take_its_slot() -> None:
    """A delta whose second is ahead of the merger's clock (a clock ahead, a bad report) is not
    stamped into the ring: the real second that shares its slot is still counted."""
    clock = Clock(1000.2)
    merged = MergedRecorder(clock=clock)
    now, slots = 1000, merged._slots
    merged.merge(1, Delta(series=[("qc", "3", (), ((now + slots, 50, 0, 0, 0, 0, ()),))]))
    merged.merge(1, Delta(series=[("qc", "3", (), ((now, 4, 0, 0, 0, 0, ()),))]))
    assert merged.window("qc", "3", 10).requests == 4


def test_a_merged_sample_holds_no_more_than_its_size_of_what_it_was_given() -> None:
    sample = MergedSample(size=8)
    sample.merge(1, [1.0] * 1000)
    sample.merge(-3, [2.0])
    assert sample.take() == [1.0] and sample.seen == 0
