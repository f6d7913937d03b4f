"""Sequence affinity: every request of a Triton sequence goes to the version that started it.

Sequence state lives in one version of one Triton server; continuing a sequence elsewhere
fails with "must specify the START flag". The pin table maps (model, sequence id) to a
version from ``sequence_start`` until ``sequence_end`` or an idle timeout, whatever the
weights do meanwhile. Bounded: the least recently used pins go first when it is full.

Every key touched is noted in a set (one ``set.add`` per request), so the control plane can
write the changed pins to the store in the background (:meth:`take_changes`) and a
restarted replica can :meth:`restore` them: sequences survive a restart.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gateway.errors import BadRequest

Key = tuple[str, object]
# What Triton takes as a sequence id: an unsigned 64-bit integer or a string. A string id is
# kept in the pin table, the store and the fleet's pins, so its length is bounded too (Triton
# sets none; 128 characters hold any UUID, hash or session key a client would use).
MAX_SEQUENCE_ID_CHARS = 128
_UINT64 = 1 << 64


@dataclass(frozen=True, slots=True)
class SequenceFields:
    """A request's place in a Triton sequence, read once by the front that parsed the request
    (``checked_sequence_id``), and carried with it to whatever needs it (a fleet pins the
    sequence to the server that holds its state)."""

    id: int | str
    start: bool = False
    end: bool = False


def checked_sequence_id(value: object) -> int | str | None:
    """A request's ``sequence_id`` as Triton takes it, or BadRequest; None: not in a sequence (0, "", absent)."""
    if value is None or value == "" or (type(value) is int and value == 0):
        return None
    if type(value) is int:
        if 0 < value < _UINT64:
            return value
        raise BadRequest(f"sequence_id {value} is not an unsigned 64-bit integer")
    if type(value) is str:
        if len(value) <= MAX_SEQUENCE_ID_CHARS:
            return value
        raise BadRequest(f"sequence_id is {len(value)} characters long; at most {MAX_SEQUENCE_ID_CHARS} are taken")
    raise BadRequest(f"sequence_id must be an unsigned integer or a string, not {type(value).__name__}")


class SequencePins:
    def __init__(self, max_entries: int = 100_000, idle_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.idle_s = idle_s
        self._clock = clock
        self._pins: OrderedDict[Key, tuple[str, float]] = OrderedDict()
        self._changed: set[Key] = set()  # touched since the last take_changes()

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
        self._changed.add(key)
        return version

    def pin(self, model: str, sequence_id: object, version: str) -> None:
        key = (model, sequence_id)
        self._pins[key] = (version, self._clock())
        self._pins.move_to_end(key)
        self._changed.add(key)
        while len(self._pins) > self.max_entries:
            self._changed.add(self._pins.popitem(last=False)[0])

    def release(self, model: str, sequence_id: object) -> None:
        self._pins.pop((model, sequence_id), None)
        self._changed.add((model, sequence_id))

    def take_changes(self) -> dict[Key, tuple[str, float] | None]:
        """Every pin touched since the last call: key -> (version, seconds idle), or None if
        it is gone (ended, evicted). Pins that idle out are not listed: the store expires them too."""
        changed, self._changed = self._changed, set()
        now = self._clock()
        out: dict[Key, tuple[str, float] | None] = {}
        for key in changed:
            entry = self._pins.get(key)
            out[key] = None if entry is None else (entry[0], now - entry[1])
        return out

    def retry(self, keys: Iterable[Key]) -> None:
        """Changes taken but not saved (the store was down): list them again next time."""
        self._changed.update(keys)

    def restore(self, pins: dict[Key, tuple[str, float]]) -> None:
        """Pins read back from the store after a restart: key -> (version, seconds idle)."""
        now = self._clock()
        for key, (version, idle) in sorted(pins.items(), key=lambda item: -item[1][1]):  # least recent first
            if idle <= self.idle_s and key not in self._pins:
                self._pins[key] = (version, now - idle)

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
