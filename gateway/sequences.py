"""Sequence affinity: every request of a Triton sequence goes to the version that started it.

Sequence state lives in one version of one Triton server; continuing a sequence elsewhere
fails with "must specify the START flag". The pin table maps (model, sequence id) to a
version from ``sequence_start`` until ``sequence_end`` or an idle timeout, whatever the
weights do meanwhile. Bounded: the least recently used pins go first when it is full.

Every key touched is noted in a set (one ``set.add`` per request), so the control plane can
write the changed pins to the store in the background (:meth:`take_changes`) and a
restarted replica can :meth:`restore` them: sequences survive a restart.

One client cannot push everyone else's pins out (issue 22): a pin made by a start belongs to
the client that sent it (its address as the front reads it: the peer, or whom a trusted proxy
forwarded), and a client holding ``max_per_client`` pins that starts one more loses its own
least recently used pin, never another client's. Evicting rather than refusing the start: a
client that abandons sequences without ``sequence_end`` (a crashed session) keeps working, and
only its own oldest sequence pays. The table's own LRU bound still holds across all clients,
so pushing out another client's pin takes ``max_entries / max_per_client`` addresses acting
together. Pins this replica did not see start (read back from the store after a restart, or
found there for a sequence started on another replica) have no owner here: the store keeps
no owner, and the replica the sequence started on holds it against its client (its eviction
there deletes the pin from the store). The quota is per table: per replica, per node with
``--workers`` (workers pin in the control plane's table, :mod:`gateway.workers.pins`).

Shared live between replicas (a :class:`PinDirectory`, the store): a sequence's start writes
its pin through to the store before the start is forwarded (its end deletes it the same
way), and a replica that has no pin
for a continuing sequence, or one not used for ``revalidate_s``, reads the store before
routing it. So a sequence whose client reconnects to another replica (after a keep-alive
timeout, say) stays on its version from its next request on, and a replica that saw a
sequence id long ago does not route its reuse by a stale pin.

Why the store and not a deterministic function of the sequence id (each replica hashing the
id onto the weights): the weights move during a rollout, and a hash onto moved weights sends
a live sequence to another version, which is the failure pins exist to prevent; and a hash
of the id would let a client choose ids that land on the version it wants to hit. The cost
is one store write per sequence start and end, and one read when a sequence comes back after a pause;
requests of a busy sequence are routed from the local table, with no I/O.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

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
    sequence to the server that holds its state). ``client``: who sent it (the peer, or whom a
    trusted proxy forwarded), whose quota a pin it makes is held against."""

    id: int | str
    start: bool = False
    end: bool = False
    client: str | None = None


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


REVALIDATE_S = 1.0  # a local pin unused this long is checked against the shared one before use


class PinDirectory(Protocol):
    """The pins every replica shares (the store, through ``services.replicas``)."""

    async def find(self, model: str, sequence_id: object) -> tuple[bool, str | None]:
        """(answered, version): the shared pin, None if there is none; answered False when
        the store could not be asked (then the local pin, if any, is used)."""

    async def publish(self, model: str, sequence_id: object, version: str | None) -> None:
        """Save one pin now, or forget it (None); errors are the directory's: it logs them,
        and the background save tries again."""


Owner = str | None  # the client that started the sequence; None: not known here (restored, read from the store)


class SequencePins:
    def __init__(self, max_entries: int = 100_000, idle_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic, max_per_client: int = 1_000) -> None:
        self.max_entries = max_entries
        self.max_per_client = max_per_client
        self.idle_s = idle_s
        self._clock = clock
        self._pins: OrderedDict[Key, tuple[str, float, Owner]] = OrderedDict()  # least recently used first
        # Each owner's pins, least recently used first: its own oldest goes when it is over its quota.
        self._owned: dict[str, OrderedDict[Key, None]] = {}
        self._changed: set[Key] = set()  # touched since the last take_changes()
        self.directory: PinDirectory | None = None  # set by the composition root when replicas share a store
        self.revalidate_s = REVALIDATE_S

    def __len__(self) -> int:
        return len(self._pins)

    def held_by(self, client: str) -> int:
        """Live pins the client started (at most ``max_per_client``)."""
        owned = self._owned.get(client)
        return 0 if owned is None else len(owned)

    def lookup(self, model: str, sequence_id: object) -> str | None:
        key = (model, sequence_id)
        entry = self._pins.get(key)
        if entry is None:
            return None
        now = self._clock()
        if now - entry[1] > self.idle_s:
            self._drop(key, entry[2])
            return None
        self._touch(key, entry[0], now, entry[2])
        return entry[0]

    def recent(self, model: str, sequence_id: object) -> str | None:
        """The pinned version when this table can answer alone: without a directory, any live
        pin (as :meth:`lookup`); with one, a pin used within ``revalidate_s``. None: ask
        :meth:`resolve`."""
        if self.directory is None:
            return self.lookup(model, sequence_id)
        key = (model, sequence_id)
        entry = self._pins.get(key)
        if entry is None:
            return None
        now = self._clock()
        if now - entry[1] > self.revalidate_s:
            return None
        self._touch(key, entry[0], now, entry[2])
        return entry[0]

    async def resolve(self, model: str, sequence_id: object, end: bool) -> str | None:
        """A continuing sequence :meth:`recent` could not answer: the shared pin (the local one
        when the store cannot be asked), kept here unless the sequence ends; None if no
        replica has one (the local pin goes too: the sequence ended or restarted elsewhere)."""
        if self.directory is None:
            return None
        answered, version = await self.directory.find(model, sequence_id)
        key = (model, sequence_id)
        if not answered:
            version = self.lookup(model, sequence_id)
        if version is None or end:
            self.release(model, sequence_id)
        else:
            entry = self._pins.get(key)
            if entry is not None and entry[0] == version:
                self._touch(key, version, self._clock(), entry[2])
            else:  # the store's pin, made on another replica: its owner is held to its quota there
                self.pin(model, sequence_id, version)
        return version

    async def share(self, model: str, sequence_id: object) -> None:
        """A sequence started (or ended) here: its pin (or its absence) goes to the directory
        now, before the request is forwarded, so the sequence's next request (or the next use
        of its id) is routed by it on any replica."""
        if self.directory is not None:
            entry = self._pins.get((model, sequence_id))
            await self.directory.publish(model, sequence_id, None if entry is None else entry[0])

    def pin(self, model: str, sequence_id: object, version: str, client: Owner = None) -> None:
        """Pin a sequence (its start) to a version, for ``client``: past its quota its own least
        recently used pin goes, past the table's bound the least recently used of all."""
        key = (model, sequence_id)
        entry = self._pins.get(key)
        if entry is not None and entry[2] != client:  # the id started again, by another client
            self._disown(key, entry[2])
        self._pins[key] = (version, self._clock(), client)
        self._pins.move_to_end(key)
        self._changed.add(key)
        if client is not None:
            owned = self._owned.get(client)
            if owned is None:
                owned = self._owned[client] = OrderedDict()
            owned[key] = None
            owned.move_to_end(key)
            if len(owned) > self.max_per_client:
                oldest = owned.popitem(last=False)[0]
                del self._pins[oldest]
                self._changed.add(oldest)
        while len(self._pins) > self.max_entries:
            evicted, (_, _, owner) = self._pins.popitem(last=False)
            self._disown(evicted, owner)
            self._changed.add(evicted)

    def repin(self, model: str, sequence_id: object, version: str, client: Owner = None) -> None:
        """Pin a sequence for a request that did not start it (its pin was lost, or names a
        server that left): a pin there was keeps its owner; a new one is ``client``'s, held to that
        client's quota like a start's, so it pushes out no other client's pin."""
        entry = self._pins.get((model, sequence_id))
        self.pin(model, sequence_id, version, client if entry is None else entry[2])

    def release(self, model: str, sequence_id: object) -> None:
        key = (model, sequence_id)
        entry = self._pins.pop(key, None)
        if entry is not None:
            self._disown(key, entry[2])
        self._changed.add(key)

    def _touch(self, key: Key, version: str, now: float, owner: Owner) -> None:
        self._pins[key] = (version, now, owner)
        self._pins.move_to_end(key)
        if owner is not None:
            self._owned[owner].move_to_end(key)
        self._changed.add(key)

    def _drop(self, key: Key, owner: Owner) -> None:
        """An idle pin goes (not a change: the store expires it too)."""
        del self._pins[key]
        self._disown(key, owner)

    def _disown(self, key: Key, owner: Owner) -> None:
        if owner is None:
            return
        owned = self._owned[owner]
        del owned[key]
        if not owned:
            del self._owned[owner]

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
        """Pins read back from the store after a restart: key -> (version, seconds idle). The
        store keeps no owner, so they have none: bounded by the table and their idle time."""
        now = self._clock()
        for key, (version, idle) in sorted(pins.items(), key=lambda item: -item[1][1]):  # least recent first
            if idle <= self.idle_s and key not in self._pins:
                self._pins[key] = (version, now - idle, None)
        while len(self._pins) > self.max_entries:
            evicted, (_, _, owner) = self._pins.popitem(last=False)
            self._disown(evicted, owner)

    def open_on(self, model: str, version: str) -> int:
        """Live sequences pinned to a version (drain waits for zero)."""
        self.expire()
        return sum(1 for (m, _), (v, _, _) in self._pins.items() if m == model and v == version)

    def expire(self) -> None:
        now = self._clock()
        while self._pins:
            key, (_, last_used, owner) = next(iter(self._pins.items()))
            if now - last_used <= self.idle_s:
                return
            self._drop(key, owner)
