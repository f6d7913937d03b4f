"""Rendering ``/metrics`` off the loop that serves inference.

Measured at 1,000 models (bench/scale.py), a scrape rendered on the event loop stopped every
request on it for the whole scrape: 2.3 s at 1,000 models, 18 s at 5,000. Here the loop only
copies the numbers (:meth:`SnapshotRegistry.freeze`: each collector's ``snapshot()``, O(label
sets), no formatting), and a thread of the registry's own formats the text. The copy is one
moment's state, so a histogram's buckets, sum and count always agree, whatever is recorded
while the text is built.

The thread shares the interpreter's lock with the loop, and a thread that only computes keeps it
for the switch interval (5 ms) each time the loop lets go of it, which the loop does at every
system call: a loop turn waited ~5 ms per call, a few turns a second went by while a 5,000-model
exposition was built (~150 loop turns/s, ~900 without a scrape). So the rendering thread paces
itself (:func:`pace`): every ``PACE_EVERY`` samples built or written it sleeps ``PACE_S``, which
hands the lock to the loop at once; the loop waits at most that many samples' work.

Collectors with a ``snapshot()`` (returning something with ``collect()``) are copied this way;
any other collector (the process, fleet and worker collectors: a few series, plain fields) is
collected on the loop as it is. Scrapes that arrive while one is rendered in the same format
share its answer: a burst of scrapes costs one rendering.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

Metric = Any  # prometheus_client.core.Metric, whose families are built off the loop
PACE_EVERY = 200  # samples built or written by the rendering thread between two pauses (~0.3 ms of work)
PACE_S = 0.0002
_rendering = threading.local()  # .count on the thread while it renders for render(): it paces itself


def pace() -> None:
    """One sample built or written; on the rendering thread every ``PACE_EVERY``-th pauses, so
    the loop takes the interpreter's lock at once (anywhere else: nothing)."""
    count = getattr(_rendering, "count", None)
    if count is not None:
        if count >= PACE_EVERY:
            count = 0
            time.sleep(PACE_S)
        _rendering.count = count + 1


class _Paced(list[Any]):
    """A family's samples, written at the rendering thread's pace."""

    def __iter__(self) -> Iterator[Any]:
        for sample in super().__iter__():
            pace()
            yield sample


def _encode_paced(encoder: Any, frozen: Frozen) -> bytes:
    _rendering.count = 0
    try:
        return bytes(encoder(frozen))
    finally:
        del _rendering.count


class Frozen:
    """One moment's metrics, ready to be encoded on any thread (what the encoders call ``registry``)."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def collect(self) -> Iterator[Metric]:
        paced = getattr(_rendering, "count", None) is not None
        for part in self.parts:
            for metric in part.collect() if hasattr(part, "collect") else part:
                if paced:
                    metric.samples = _Paced(metric.samples)
                yield metric


class SnapshotRegistry(CollectorRegistry):
    """A ``CollectorRegistry`` whose :meth:`render` copies on the calling loop and encodes on
    a thread of its own. ``get_sample_value`` and the encoders work on it as on any registry."""

    def __init__(self) -> None:
        super().__init__(auto_describe=False)
        self._ordered: list[Collector] = []
        self._executor: ThreadPoolExecutor | None = None
        self._rendering: dict[str, asyncio.Future[bytes]] = {}

    def register(self, collector: Collector) -> None:
        super().register(collector)
        self._ordered.append(collector)

    def unregister(self, collector: Collector) -> None:
        super().unregister(collector)
        self._ordered.remove(collector)

    def freeze(self) -> Frozen:
        """Every collector's numbers now (on the serving loop: copies only)."""
        parts: list[Iterable[Metric] | Any] = []
        for collector in self._ordered:
            snapshot = getattr(collector, "snapshot", None)
            parts.append(snapshot() if snapshot is not None else list(collector.collect()))
        return Frozen(parts)

    async def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition in the format ``accept`` asks for, encoded off this loop."""
        encoder, content_type = choose_encoder(accept or "")
        pending = self._rendering.get(content_type)
        if pending is None:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="metrics-render")
            frozen = self.freeze()
            pending = asyncio.get_running_loop().run_in_executor(self._executor, _encode_paced, encoder, frozen)
            self._rendering[content_type] = pending
            pending.add_done_callback(lambda _: self._rendering.pop(content_type, None))
        return await asyncio.shield(pending), content_type

    def close(self) -> None:
        """Stop the rendering thread (a scrape under way finishes first)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

