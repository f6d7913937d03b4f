"""What an unload must know about every replica, not just this one: drains and model locks.

Each replica runs a reporter that publishes, through the store, its requests in flight and
its live sequence pins for every version being drained (every second when nothing drains,
five times a second while something does). Its report expires when it stops, so a dead
replica is never waited on.

A drain marks the version in the store, then waits until every live replica has answered
*this* drain (by its id) with nothing in flight and nothing pinned. If sequences are still
pinned at the drain timeout, the unload is refused, naming how many and where: unloading
would break them. Requests still in flight at the timeout do not stop it (they are stuck
past any client's patience).

Loads and unloads of a model take a store lease first, so two replicas (an SRE's load on
one, the lease holder's promotion cleanup on another) never reload the same model at once.

Sequence pins are written to the store in the background (twice a second, only the pins
touched since) and read back at start, so the sequences a replica pinned survive its
restart; in the store they expire by idle time like in memory. This class is also the pin
table's :class:`~gateway.sequences.PinDirectory`: a sequence's start is written through at
once and a replica without a (recent) pin reads the store, so pins are shared live between
replicas (see :mod:`gateway.sequences` for why the store and not a hash of the id).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Mapping

from gateway.background import Background
from gateway.errors import Conflict, StoreError
from gateway.sequences import SequencePins
from gateway.store.base import ReplicaReport, StateStore
from gateway.telemetry.recorder import Recorder

log = logging.getLogger("gateway.replicas")
REPORT_S = (0.2, 1.0)  # report period while something drains, and otherwise
REPORT_TTL_S = 3.0  # a replica silent this long is gone
LOCK_TTL_S = 10.0  # renewed every third of it while held; a crashed holder frees it this fast
PIN_SAVE_S = 0.5
PIN_CALL_S = 1.0  # a request waits this long at most for the store to read or write its sequence's pin


def replica_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Replicas:
    def __init__(self, store: StateStore, recorder: Recorder, pins: SequencePins, replica: str | None = None) -> None:
        self.store = store
        self.recorder = recorder
        self.pins = pins
        self.replica = replica or replica_name()
        self._wake = asyncio.Event()  # a drain started here: report at once
        self._background = Background()

    def start(self) -> None:
        def crashed(name: str, _: BaseException) -> None:
            self.recorder.count_loop_restart(name)

        self._background.supervise("replica-report", self.report_forever, crashed)
        self._background.supervise("pin-save", self.save_pins_forever, crashed)

    async def stop(self) -> None:
        await self._background.cancel_all()
        with contextlib.suppress(StoreError):
            await self.save_pins()  # the last changes, so a restart finds them

    # -- sequence pins in the store -------------------------------------------------------------
    async def find(self, model: str, sequence_id: object) -> tuple[bool, str | None]:
        """The pin directory's read (on a request's path, only when this replica has no recent pin)."""
        if not isinstance(sequence_id, (int, str)):
            return True, None
        try:
            async with asyncio.timeout(PIN_CALL_S):
                entry = await self.store.load_pin(json.dumps([model, sequence_id]), self.pins.idle_s)
        except (StoreError, TimeoutError) as exc:
            log.debug("reading the pin of sequence %r of '%s' failed: %s", sequence_id, model, exc)
            return False, None
        return True, None if entry is None else entry[0]

    async def publish(self, model: str, sequence_id: object, version: str | None) -> None:
        """The pin directory's write-through of a sequence's start or end (the background save
        retries a failure)."""
        if not isinstance(sequence_id, (int, str)):
            return
        try:
            async with asyncio.timeout(PIN_CALL_S):
                entry = None if version is None else (version, time.time())
                await self.store.save_pins({json.dumps([model, sequence_id]): entry}, self.pins.idle_s)
        except (StoreError, TimeoutError) as exc:
            log.debug("saving the pin of sequence %r of '%s' failed: %s", sequence_id, model, exc)

    async def restore_pins(self) -> int:
        """Read back the pins saved before a restart; how many were live."""
        now, restored = time.time(), {}
        for key, (version, used_at) in (await self.store.load_pins(self.pins.idle_s)).items():
            parsed = _pin_key(key)
            if parsed is not None:
                restored[parsed] = (version, max(0.0, now - used_at))
        self.pins.restore(restored)
        return len(restored)

    async def save_pins_forever(self) -> None:
        while True:
            await asyncio.sleep(PIN_SAVE_S)
            try:
                await self.save_pins()
            except StoreError as exc:
                log.debug("saving sequence pins failed: %s", exc)  # kept, and tried again

    async def save_pins(self) -> None:
        changes = self.pins.take_changes()
        if not changes:
            return
        now = time.time()
        saved: dict[str, tuple[str, float] | None] = {}
        for (model, sequence), entry in changes.items():
            if isinstance(sequence, (int, str)):  # what Triton's sequence ids are; anything else stays local
                saved[json.dumps([model, sequence])] = None if entry is None else (entry[0], now - entry[1])
        try:
            await self.store.save_pins(saved, self.pins.idle_s)
        except StoreError:
            self.pins.retry(changes)
            raise

    # -- this replica's report ----------------------------------------------------------------
    async def report_forever(self) -> None:
        while True:
            draining: dict[tuple[str, str], str] = {}
            self._wake.clear()
            try:
                draining = await self.store.draining()
                await self.store.report_replica(self._report(draining), REPORT_TTL_S)
            except StoreError as exc:
                log.debug("replica report failed: %s", exc)  # state sync reports the store being down
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), REPORT_S[0] if draining else REPORT_S[1])

    def _report(self, draining: dict[tuple[str, str], str]) -> ReplicaReport:
        usage = {f"{model}/{version}": (self.recorder.inflight.get((model, version), 0),
                                        self.pins.open_on(model, version), drain_id)
                 for (model, version), drain_id in draining.items()}
        return ReplicaReport(self.replica, time.time(), usage)

    # -- drains and locks -----------------------------------------------------------------------
    async def drain(self, model: str, version: str, timeout_s: float) -> str:
        """Wait until no live replica has a request in flight to, or a sequence pinned on, the
        version; Conflict if sequences are still pinned at the timeout."""
        drain_id = uuid.uuid4().hex
        key = f"{model}/{version}"
        await self.store.set_draining(model, version, drain_id, ttl_s=timeout_s + 30)
        self._wake.set()
        started = time.monotonic()
        try:
            while True:
                reports = await self.store.live_replicas()
                silent = [r.replica for r in reports if key not in r.usage or r.usage[key][2] != drain_id]
                busy = {r.replica: r.usage[key][:2] for r in reports if r.replica not in silent and
                        (r.usage[key][0] > 0 or r.usage[key][1] > 0)}
                elapsed = time.monotonic() - started
                if not silent and not busy:
                    return f"idle on {len(reports)} replica(s) after {elapsed:.1f}s"
                if elapsed >= timeout_s:
                    return _timed_out(model, version, timeout_s, busy, silent)
                await asyncio.sleep(0.1)
        finally:
            with contextlib.suppress(StoreError):
                await self.store.set_draining(model, version, None)

    @contextlib.asynccontextmanager
    async def lock(self, model: str, wait_s: float) -> AsyncIterator[None]:
        """Hold the model's lifecycle lease (across replicas) for the block; wait up to
        ``wait_s`` for it, then Conflict."""
        name, holder = f"lifecycle:{model}", f"{self.replica}/{uuid.uuid4().hex[:8]}"
        deadline = time.monotonic() + wait_s
        while not await self.store.acquire_lease(name, holder, LOCK_TTL_S):
            if time.monotonic() > deadline:
                raise Conflict(f"another load or unload of model '{model}' is in progress (on this or another "
                               f"replica) and did not finish within {wait_s:g}s: retry later")
            await asyncio.sleep(0.1)
        renewing = asyncio.get_running_loop().create_task(self._renew(name, holder))
        try:
            yield
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing
            with contextlib.suppress(StoreError):
                await self.store.release_lease(name, holder)

    async def _renew(self, name: str, holder: str) -> None:
        while True:
            await asyncio.sleep(LOCK_TTL_S / 3)
            try:
                if not await self.store.acquire_lease(name, holder, LOCK_TTL_S):
                    log.error("lost the %s lease while holding it (the store was reset?)", name)
            except StoreError as exc:
                log.warning("could not renew the %s lease: %s", name, exc)


def _pin_key(key: str) -> tuple[str, object] | None:
    try:
        model, sequence = json.loads(key)
    except ValueError:
        return None
    return (model, sequence) if isinstance(model, str) and isinstance(sequence, (int, str)) else None


def _timed_out(model: str, version: str, timeout_s: float, busy: Mapping[str, tuple[int, ...]],
               silent: list[str]) -> str:
    pinned = {replica: counts[1] for replica, counts in busy.items() if counts[1] > 0}
    if pinned:
        where = ", ".join(f"{count} on {replica}" for replica, count in sorted(pinned.items()))
        raise Conflict(f"version {version} of model '{model}' still has {sum(pinned.values())} open sequence(s) "
                       f"pinned to it after the {timeout_s:g}s drain ({where}): not unloaded, as that would break "
                       "them; it takes no new traffic. Retry once they end or go idle")
    inflight = sum(counts[0] for counts in busy.values())
    note = f", {len(silent)} replica(s) did not answer" if silent else ""
    return f"timed out after {timeout_s:g}s with {inflight} request(s) still in flight{note}"
