"""One timer per event loop for the time bounds of every client connection, on both ports.

A connection has bounds in time (its HTTP/2 preface, a header block, idle, keep-alive, a
request's head or body, the flood counters' one-second window). Checked by a timer of each
connection's own, every second, 5,000 idle gRPC connections cost 43-57 ms of CPU a second
doing nothing. Here each connection that has a bound is filed under the tick its earliest
bound could fall due, and the loop's one timer wakes each tick and visits only the
connections filed under it: an idle connection is visited once per its timeout, not once a
second, and a request costs a connection no timer at all (it stamps ``tick`` on itself, an
attribute read; the visit compares the stamp with the bound and files the connection again
for its next one).

A tick is ``RESOLUTION`` (0.25 s): a bound of ``t`` seconds is met between ``t`` and ``t`` +
0.25 s late. The timer stops when no connection is filed, so a loop without clients has none.
Neither port nor HTTP/2 is imported here (``tests/unit/test_architecture.py``).
"""

from __future__ import annotations

import asyncio
import math
import weakref
from typing import Protocol

RESOLUTION = 0.25  # seconds per tick
TICKS_PER_S = 4


class Swept(Protocol):
    """A connection the sweep visits: ``sweep_due`` is the tick it is filed under (0: none)."""

    sweep_due: int

    def swept(self) -> None:
        """Its tick came: check its bounds against ``Sweep.tick``, act, and file itself again if it
        still has one (``Sweep.at``)."""


class Sweep:
    """The timing wheel of one event loop (``Sweep.of(loop)``)."""

    __slots__ = ("loop", "tick", "_done", "_buckets", "_timer", "__weakref__")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.tick = self._now()  # the coarse clock connections stamp themselves with
        self._done = self.tick  # the last tick whose connections were visited
        self._buckets: dict[int, set[Swept]] = {}
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Sweep:
        sweep = _SWEEPS.get(loop)
        if sweep is None:
            sweep = _SWEEPS[loop] = cls(loop)
        return sweep

    def _now(self) -> int:
        return int(self.loop.time() * TICKS_PER_S)

    @staticmethod
    def ticks(seconds: float) -> int:
        """A bound in seconds, in whole ticks (at least one)."""
        return max(1, math.ceil(seconds * TICKS_PER_S))

    def at(self, item: Swept, ticks: int) -> None:
        """Visit ``item`` ``ticks`` ticks from now (instead of when it was filed for before)."""
        if self._timer is None:
            self.tick = self._now()  # the clock stood still while nothing was filed
        due = self.tick + max(ticks, 1)
        filed = item.sweep_due
        if filed == due:
            return
        if filed:
            bucket = self._buckets.get(filed)
            if bucket is not None:
                bucket.discard(item)
        bucket = self._buckets.get(due)
        if bucket is None:
            bucket = self._buckets[due] = set()
        bucket.add(item)
        item.sweep_due = due
        if self._timer is None:
            self._done = self.tick
            self._timer = self.loop.call_at((self.tick + 1) / TICKS_PER_S, self._run)

    def cancel(self, item: Swept) -> None:
        """``item`` is gone (its connection closed): it is visited no more."""
        filed, item.sweep_due = item.sweep_due, 0
        if filed:
            bucket = self._buckets.get(filed)
            if bucket is not None:
                bucket.discard(item)

    @property
    def filed(self) -> int:
        """Connections waiting for a visit (what a test counts instead of timers)."""
        return sum(len(bucket) for bucket in self._buckets.values())

    def _run(self) -> None:
        now = self.tick = self._now()
        buckets = self._buckets
        for tick in range(self._done + 1, now + 1):  # every tick since the last run (a busy loop runs late)
            due = buckets.pop(tick, None)
            if due:
                for item in due:
                    item.sweep_due = 0
                    item.swept()
        self._done = now
        if buckets:
            self._timer = self.loop.call_at((now + 1) / TICKS_PER_S, self._run)
        else:
            self._timer = None


_SWEEPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Sweep] = weakref.WeakKeyDictionary()
