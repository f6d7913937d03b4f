"""Rendering ``/metrics`` off the loop that serves inference.

Measured at 1,000 models (bench/scale.py), a scrape rendered on the event loop stopped every
request on it for the whole scrape: 2.3 s at 1,000 models, 18 s at 5,000. Here the loop only
copies the numbers (:meth:`SnapshotRegistry.freeze`: each collector's ``snapshot()``, O(label
sets), no formatting), and a thread of the registry's own formats the text. The copy is one
moment's state, so a histogram's buckets, sum and count always agree, whatever is recorded
while the text is built.

Collectors with a ``snapshot()`` (returning something with ``collect()``) are copied this way;
any other collector (the process, fleet and worker collectors: a few series, plain fields) is
collected on the loop as it is. Scrapes that arrive while one is rendered in the same format
share its answer: a burst of scrapes costs one rendering.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

Metric = Any  # prometheus_client.core.Metric, whose families are built off the loop


class Frozen:
    """One moment's metrics, ready to be encoded on any thread (what the encoders call ``registry``)."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def collect(self) -> Iterator[Metric]:
        for part in self.parts:
            yield from (part.collect() if hasattr(part, "collect") else part)


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
            pending = asyncio.get_running_loop().run_in_executor(self._executor, encoder, frozen)
            self._rendering[content_type] = pending
            pending.add_done_callback(lambda _: self._rendering.pop(content_type, None))
        return await asyncio.shield(pending), content_type

    def close(self) -> None:
        """Stop the rendering thread (a scrape under way finishes first)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

