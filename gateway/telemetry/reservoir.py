"""A bounded uniform sample of latencies: what the statistical judge's rank test reads.

Histogram buckets up to 1.5x wide cannot tell a 20% latency shift, and keeping every latency
is unbounded, so each (model, version) keeps a reservoir: a uniform random sample of at most
``size`` of the values added since the control plane last took it. Li's Algorithm L
(ACM TOMS 20(4), 1994) draws how many values to SKIP before the next replacement, so once
the reservoir is full an ``add`` is one increment and one comparison; random numbers are
drawn only at replacements, about ``size * ln(seen / size)`` times in all. No locks: the data
plane and the control plane share one event loop. Measured in bench/reservoir.py.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

DEFAULT_SIZE = 1024


class Reservoir:
    """A uniform sample, without replacement, of at most ``size`` of the values added since
    the last :meth:`take` (or since creation)."""

    __slots__ = ("size", "seen", "_values", "_next", "_log_w", "_random")

    def __init__(self, size: int = DEFAULT_SIZE, rng: Callable[[], float] | None = None) -> None:
        assert size >= 1, "a reservoir holds at least one value"
        self.size = size
        self.seen = 0
        self._values = [0.0] * size  # allocated once: add() never grows a list
        self._next = 0  # the count at which the next replacement happens (set when full)
        self._log_w = 0.0
        self._random = rng or random.Random().random

    def add(self, value: float) -> None:
        """O(1): one increment and one comparison, except at the rare replacements."""
        seen = self.seen = self.seen + 1
        if seen <= self.size:
            self._values[seen - 1] = value
            if seen == self.size:
                self._log_w = self._log_uniform() / self.size
                self._skip()
        elif seen == self._next:
            self._values[int(self._random() * self.size)] = value
            self._log_w += self._log_uniform() / self.size
            self._skip()

    def take(self) -> list[float]:
        """The sample (at most ``size`` values, in no particular order); the reservoir starts over."""
        sample = self._values[:min(self.seen, self.size)]
        self.seen = 0
        return sample

    def _skip(self) -> None:
        # Algorithm L: the next replacement comes after Geometric(W) skipped values.
        w = math.exp(self._log_w)
        skip = math.floor(self._log_uniform() / math.log1p(-w)) if w < 1 else 0
        self._next = self.seen + skip + 1

    def _log_uniform(self) -> float:
        return math.log(1.0 - self._random())  # 1 - U is in (0, 1]: never log(0)
