"""One judge over every replica without Prometheus: replicas publish their rollout windows
through the store, and the lease holder judges the sum.

With ``metrics_source: recorder`` each replica's judge used to see only its own traffic: with
two replicas the lease holder reached a verdict on half the evidence (the chaos soak had to
lower its thresholds for it). Now every replica, the holder included, publishes every second,
while rollouts are active, what its recorder saw of their versions: the same deltas its workers
send (:class:`gateway.workers.deltas.Delta`: per-second counts and latency histograms, the
latency reservoirs and per-client tables the statistical judge takes), of completed seconds,
each once. The lease holder reads what every replica published since its last tick into a
:class:`~gateway.workers.deltas.MergedRecorder` of its own (the *fleet view*: ``/metrics``
keeps each replica's own numbers, so Prometheus' sums stay right) and judges that; each
verdict names the replicas whose windows it covers. A replica that takes the lease over reads
the store's last ``KEEP_S`` (the recorder's horizon) first, so an interval begun before the
hand-over is judged whole.

Seconds cross replicas as wall-clock time (each recorder counts in its own monotonic seconds):
a publisher sends its offset, the reader shifts each second by the difference (whole seconds).
What is published is JSON, never pickle: whoever can write the store must not be able to run
code on the gateway. With ``metrics_source: prometheus`` nothing is published (Prometheus
already sums every replica).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Any

from gateway.background import Background
from gateway.errors import StoreError
from gateway.store.base import StateStore, StoredRollout
from gateway.store.budget import bounded, call_budget
from gateway.telemetry.recorder import HIST_SECONDS, LATENCY_BOUNDS, Recorder
from gateway.telemetry.reservoir import DEFAULT_SIZE
from gateway.workers.deltas import Delta, MergedRecorder, Sample, Second, sparse

log = logging.getLogger("gateway.replicas")
PUBLISH_S = 1.0  # a replica publishes this often while rollouts are active
ROLLOUTS_S = 2.0  # and looks at which rollouts are active this often
KEEP_S = 300.0  # the store keeps this much (the recorder's horizon): a new holder reads it all
MAX_REPORT = 16 << 20  # a report past this is not read (one replica's second of a few versions is KBs)
# a second is sent again (its growth) until this many seconds after it: with --workers the
# control plane's recorder gets a second's last requests up to a report (0.25 s) after it ended
SETTLE_S = 3
BACKFILL_S = 60  # a version's first report covers this much before it (its window's start, if recent)
NO_OUTCOMES: tuple[int, ...] = ()  # the fleet view counts no outcomes (each replica's /metrics has its own)
HIST_BUCKETS = len(LATENCY_BOUNDS) + 1  # a latency histogram's buckets
ACTIVE = frozenset(["progressing", "paused", "rolling_back"])  # rollout states that are judged (rollout.phases)


def versions_of(document: dict[str, Any]) -> set[str]:
    """The versions a rollout record judges: its canary and its reference (baseline or stable)."""
    return {str(v) for v in (document.get("canary"), document.get("baseline") or document.get("stable")) if v}


class WindowTap:
    """What a recorder saw of some versions since the last take, as a :class:`Delta`: each
    second's counts and histogram (a recent one as far as it got, its growth at the next takes,
    until it is ``SETTLE_S`` old), and the latency samples and client tables of watched versions. Reads the recorder;
    takes only the samples and client tables (which only a judge takes, and on every replica the
    judge now reads the published ones)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self._sent_until: dict[tuple[str, str], int] = {}  # the last settled second published, per version
        # what was published of a version's unsettled seconds: their counts and histograms
        self._partial: dict[tuple[tuple[str, str], int], tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def take(self, versions: set[tuple[str, str]]) -> Delta:
        recorder, delta = self.recorder, Delta()
        now = int(recorder.now())
        for key in list(self._sent_until):
            if key not in versions:
                del self._sent_until[key]
        settled = now - SETTLE_S
        for pair in list(self._partial):
            if pair[0] not in versions:
                del self._partial[pair]  # each other one is visited (and let go, once settled) below
        for key in versions:
            start = self._sent_until.get(key, now - BACKFILL_S - 1) + 1
            seconds = [taken for second in range(max(start, now - HIST_SECONDS + 1), now + 1)
                       if (taken := self._take_second(key, second, settled)) is not None]
            if seconds:
                delta.series.append((key[0], key[1], NO_OUTCOMES, tuple(seconds)))
            self._sent_until[key] = settled
            if key in recorder.watched():
                self._take_samples(delta, key)
        return delta

    def _take_second(self, key: tuple[str, str], second: int, settled: int) -> Second | None:
        partial = self._partial.pop((key, second), None)
        counts = self.recorder.second_counts(*key, second)
        if counts is None:
            return None
        numbers, hist = counts[:5], tuple(counts[5]) if counts[5] is not None else ()
        if partial is not None:
            sent, sent_hist = partial
            change = tuple(a - b for a, b in zip(numbers, sent))
            hist_change = sparse(hist, sent_hist) if hist and sent_hist else sparse(hist) if hist else ()
        else:
            change, hist_change = tuple(numbers), sparse(hist) if hist else ()
        if second > settled:
            self._partial[(key, second)] = (tuple(numbers), hist)
        if any(change) or hist_change:
            return second, change[0], change[1], change[2], change[3], change[4], hist_change
        return None

    def _take_samples(self, delta: Delta, key: tuple[str, str]) -> None:
        recorder = self.recorder
        latencies = recorder.take_latencies(*key)
        if latencies:
            delta.samples[key] = (len(latencies), latencies)
        clients = recorder.take_clients(*key)
        if clients:
            delta.clients[key] = clients
        for first, values in zip((True, False), recorder.take_stream(*key)):
            if values:
                delta.stream_samples[(key[0], key[1], first)] = (len(values), values)


def encode(delta: Delta, replica: str, offset: float, seq: int = 0) -> str:
    """The published form (JSON): ``offset`` is the replica's wall clock minus its recorder's
    clock; ``seq`` numbers the replica's reports (it knows its own that way)."""
    return json.dumps({
        "replica": replica, "offset": offset, "seq": seq,
        "seconds": [[m, v, s, *counts, [list(pair) for pair in hist]]
                    for m, v, _, seconds in delta.series for s, *counts, hist in seconds],
        "samples": [[m, v, seen, values] for (m, v), (seen, values) in delta.samples.items()],
        "clients": [[m, v, {c: list(n) for c, n in table.items()}] for (m, v), table in delta.clients.items()],
        "streams": [[m, v, first, seen, values] for (m, v, first), (seen, values) in delta.stream_samples.items()],
    }, separators=(",", ":"))


FUTURE_S = 2  # a second this far past the reader's now refuses the report (its clock runs ahead)
_MAX_COUNT = 1 << 53  # a count past this is not one a replica counted


class Refused(ValueError):
    """A published report that is not one (another gateway version's, a broken writer's)."""


def _refuse_constant(name: str) -> float:
    raise Refused(f"{name} is not a number")


def _count(value: Any) -> int:
    if type(value) is not int or not 0 <= value < _MAX_COUNT:
        raise Refused(f"{value!r} is not a count")
    return value


def _list(value: Any, length: int | None = None) -> list[Any]:
    if not isinstance(value, list) or (length is not None and len(value) != length):
        raise Refused(f"{str(value)[:40]!r} is not a list" + (f" of {length}" if length is not None else ""))
    return value


def _name(value: Any) -> str:
    if not isinstance(value, str):
        raise Refused(f"{str(value)[:40]!r} is not a name")
    return value


def _sample(seen: Any, values: Any) -> Sample:
    seen = _count(seen)
    values = _list(values)
    if len(values) > min(seen, DEFAULT_SIZE):
        raise Refused(f"{len(values)} sampled values of {seen}")
    for value in values:
        if type(value) not in (int, float) or not math.isfinite(value):
            raise Refused(f"{str(value)[:40]!r} is not a latency")
    return seen, [float(value) for value in values]


def decode(text: str, local_offset: float, now: int | None = None) -> tuple[str, Delta]:
    """(replica, the delta in this process's recorder seconds); :class:`Refused` (a ValueError)
    for what is not one, whole: each field's type, finite numbers, counts >= 0, histogram buckets
    in range, samples no more than they were drawn from. Seconds older than the recorder keeps
    are dropped; one past ``now`` (this recorder's second) + ``FUTURE_S`` refuses the report."""
    doc = json.loads(text, parse_constant=_refuse_constant)
    if not isinstance(doc, dict):
        raise Refused("not a JSON object")
    replica, offset = _name(doc.get("replica")), doc.get("offset", "")
    if type(offset) not in (int, float) or not math.isfinite(offset) or abs(offset) > 1e12:
        raise Refused(f"offset {offset!r}")
    shift = round(float(offset) - local_offset)
    delta = Delta()
    series: dict[tuple[str, str], list[Second]] = {}
    for entry in _list(doc.get("seconds")):
        m, v, s, requests, errors, client_errors, overloads, rejected, hist = _list(entry, 9)
        if type(s) is not int or abs(s) > _MAX_COUNT:
            raise Refused(f"second {s!r}")
        second = s + shift
        if now is not None and second > now + FUTURE_S:
            raise Refused(f"second {second - now} s in the future")
        buckets = []
        for pair in _list(hist):
            bucket, count = _list(pair, 2)
            if _count(bucket) >= HIST_BUCKETS:
                raise Refused(f"histogram bucket {bucket}")
            buckets.append((bucket, _count(count)))
        counts = (_count(requests), _count(errors), _count(client_errors), _count(overloads), _count(rejected))
        if now is not None and second <= now - KEEP_S:
            continue  # older than the recorder keeps: nothing to add
        series.setdefault((_name(m), _name(v)), []).append((second, *counts, tuple(buckets)))
    delta.series = [(m, v, NO_OUTCOMES, tuple(seconds)) for (m, v), seconds in series.items()]
    for entry in _list(doc.get("samples", [])):
        m, v, seen, values = _list(entry, 4)
        delta.samples[(_name(m), _name(v))] = _sample(seen, values)
    for entry in _list(doc.get("clients", [])):
        m, v, table = _list(entry, 3)
        if not isinstance(table, dict):
            raise Refused("a client table that is not an object")
        delta.clients[(_name(m), _name(v))] = {
            _name(c): (_count(n[0]), _count(n[1]), _count(n[2]), _count(n[3]))
            for c, n in table.items() if _list(n, 4)}
    for entry in _list(doc.get("streams", [])):
        m, v, first, seen, values = _list(entry, 5)
        if not isinstance(first, bool):
            raise Refused(f"{first!r} is not true or false")
        delta.stream_samples[(_name(m), _name(v), first)] = _sample(seen, values)
    return replica, delta


class FleetView(MergedRecorder):
    """The lease holder's view: every replica's published windows added up; and who reported."""

    def __init__(self) -> None:
        super().__init__()
        self.reported: dict[str, int] = {}  # replica -> the newest second (this recorder's) it covered
        self._ids: dict[str, int] = {}

    def add(self, replica: str, delta: Delta) -> None:
        for model, version in (*delta.samples, *delta.clients):
            self.watch_latencies(model, version)  # a new holder's first read: samples come before its tick
        self.merge(self._ids.setdefault(replica, len(self._ids) + 1), delta)
        newest = max((entry[0] for _, _, _, seconds in delta.series for entry in seconds), default=None)
        if newest is not None:
            self.reported[replica] = max(newest, self.reported.get(replica, newest))

    def reporters(self, seconds: float) -> list[str]:
        """The replicas whose published windows cover part of the last ``seconds``."""
        since = int(self.now()) - max(1, int(seconds)) - 1
        return sorted(replica for replica, newest in self.reported.items() if newest >= since)


class ReplicaWindows:
    """Every replica: publish (while rollouts are active). The lease holder: :meth:`refresh`
    the fleet view before each tick."""

    def __init__(self, store: StateStore, recorder: Recorder, replica: str) -> None:
        # Bounded: the holder's refresh runs inside the tick's call budget, and a publish has one
        # of its own, so a locked or silent store never holds a tick (nor, on SQLite, the one
        # connection the tick's own calls wait for) longer than that budget.
        self.store = bounded(store)
        self.recorder = recorder
        self.replica = replica
        self.tap = WindowTap(recorder)
        self.view = FleetView()
        self.published = 0  # reports written, for tests and the curious
        self.refused = 0  # published reports that were not ones, skipped
        self._refused_from: set[str] = set()  # replicas whose refusal was logged (once each)
        self._versions: set[tuple[str, str]] = set()  # the active rollouts' versions
        self._statistical: set[tuple[str, str]] = set()  # those whose latencies are sampled
        self._cursor: str | None = None  # the holder's place in what was published; None: not reading
        self._holding = False  # caught up as the holder: its own windows go into the view as taken
        self._seq = 0  # this replica's reports, numbered
        self._direct: set[int] = set()  # those of its reports already in the view (not to be read again)
        self._looked = 0.0  # when the active rollouts were last read
        self._background = Background()

    def start(self) -> None:
        def crashed(name: str, _: BaseException) -> None:
            self.recorder.count_loop_restart(name)

        self._background.supervise("window-publish", self._publish_forever, crashed)

    async def stop(self) -> None:
        await self._background.cancel_all()

    async def _publish_forever(self) -> None:
        while True:
            await asyncio.sleep(PUBLISH_S)
            try:
                with call_budget(PUBLISH_S / 2):
                    if time.monotonic() - self._looked >= ROLLOUTS_S:
                        await self._look_at_rollouts()
                    await self.publish()
            except StoreError as exc:
                log.debug("publishing this replica's windows failed: %s", exc)  # state sync reports the store

    async def _look_at_rollouts(self, known: dict[str, StoredRollout] | None = None) -> None:
        """The active rollouts' versions, from the store, or from ``known`` (the holder's tick has
        just listed them, or judges from memory while the store is away: its own windows of a
        rollout begun just before still go into its view)."""
        self._looked = time.monotonic()
        versions: set[tuple[str, str]] = set()
        statistical: set[tuple[str, str]] = set()
        for model, stored in (known if known is not None else await self.store.list_rollouts()).items():
            document = stored.document
            if document.get("state") not in ACTIVE:
                continue
            keys = {(model, version) for version in versions_of(document)}
            versions |= keys
            if (document.get("spec") or {}).get("judge", "statistical") == "statistical":
                statistical |= keys
        for key in self._statistical - statistical:
            self.recorder.unwatch_latencies(*key)
        for key in statistical:
            self.recorder.watch_latencies(*key)  # this replica's latencies, sampled for the judge
        self._versions, self._statistical = versions, statistical

    async def publish(self) -> None:
        """This replica's windows of the active rollouts' versions since its last report; the lease
        holder adds its own to its fleet view at once (the store's copy is for a successor)."""
        if not self._versions:
            return
        delta = self.tap.take(self._versions)
        if not (delta.series or delta.samples or delta.clients or delta.stream_samples):
            return
        self._seq += 1
        seq = self._seq
        if self._holding:  # decided when taken: a read that catches up meanwhile will not skip it wrongly
            self.view.add(self.replica, delta)
            self._direct.add(seq)
        offset = time.time() - self.recorder.now()
        # a write that failed may still have landed: its number stays in _direct (it is not read twice)
        await self.store.publish_windows(self.replica, encode(delta, self.replica, offset, seq), KEEP_S)
        self.published += 1

    async def refresh(self, known: dict[str, StoredRollout] | None = None) -> None:
        """The lease holder, in each tick before it judges: its own windows up to now, and what
        every other replica published since the last call (all the store keeps, its own too, the
        first time: an interval begun before the hand-over is judged whole) added to the fleet
        view. ``known``: the rollouts the tick judges (listed, or from memory); None: the store's."""
        if self._cursor is None:
            self.view = FleetView()  # a new holder starts from what the store kept, not an older view
            self._cursor, self._holding = "", False
            self._direct.clear()
        elif self._holding:
            if known is not None or time.monotonic() - self._looked >= ROLLOUTS_S:
                await self._look_at_rollouts(known)  # a rollout begun this tick: its versions from now on
            await self.publish()  # into the view at once: a store that is away fails only its copy
        local = time.time() - self.view.now()
        while True:
            cursor, entries = await self.store.read_windows(self._cursor)
            now = int(self.view.now())
            for replica, text in entries:  # no await in here: the page is read whole, each entry once
                self._read_one(replica, text, local, now)
            self._cursor = cursor
            if not entries:
                self._holding = True  # caught up (no await since): from now on its own go straight in
                return

    def _read_one(self, replica: str, text: str, local: float, now: int) -> None:
        """One published report into the fleet view, or refused whole (counted, and logged once
        per replica): one bad entry must not stop the judge, nor be half added."""
        try:
            if len(text) > MAX_REPORT:
                raise Refused(f"a report of {len(text)} bytes")
            name, delta = decode(text, local, now)
            if name == self.replica and self._direct:
                seq = json.loads(text).get("seq")
                if seq in self._direct:
                    self._direct.discard(seq)
                    return  # added at once when it was taken
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError, RecursionError) as exc:
            self.refused += 1
            if replica not in self._refused_from:
                self._refused_from.add(replica)
                log.warning("windows published by %s cannot be read (%s): skipped (and any more of its, "
                            "logged once)", replica, exc)
            return
        self.view.add(name, delta)

    def stop_reading(self) -> None:
        """The lease is gone: the next holder reads afresh (and so would this replica, later)."""
        self._cursor, self._holding = None, False
        self._direct.clear()

