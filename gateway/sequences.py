"""Sequence affinity: every request of a Triton sequence goes to the version that started it.

Sequence state lives in one version of one Triton server; continuing a sequence elsewhere
fails with "must specify the START flag". The pin table maps (model, sequence id) to a
version from ``sequence_start`` until ``sequence_end`` or an idle timeout, whatever the
weights do meanwhile. Bounded: the least recently used pins go first when it is full.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

Key = tuple[str, object]


class SequencePins:
    def __init__(self, max_entries: int = 100_000, idle_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.idle_s = idle_s
        self._clock = clock
        self._pins: OrderedDict[Key, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pins)

    def lookup(self, model: str, sequence_id: object) -> str | None:
        key = (model, sequence_id)
        entry = self._pins.get(key)
        if entry is None:
            return None
        version, last_used = entry
        now = self._clock()
        if now - last_used > self.idle_s:
            del self._pins[key]
            return None
        self._pins[key] = (version, now)
        self._pins.move_to_end(key)
        return version

    def pin(self, model: str, sequence_id: object, version: str) -> None:
        self._pins[(model, sequence_id)] = (version, self._clock())
        self._pins.move_to_end((model, sequence_id))
        while len(self._pins) > self.max_entries:
            self._pins.popitem(last=False)

    def release(self, model: str, sequence_id: object) -> None:
        self._pins.pop((model, sequence_id), None)

    def open_on(self, model: str, version: str) -> int:
        """Live sequences pinned to a version (drain waits for zero)."""
        self.expire()
        return sum(1 for (m, _), (v, _) in self._pins.items() if m == model and v == version)

    def expire(self) -> None:
        now = self._clock()
        while self._pins:
            key, (_, last_used) = next(iter(self._pins.items()))
            if now - last_used <= self.idle_s:
                return
            del self._pins[key]
