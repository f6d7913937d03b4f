"""In-process store: the contract without durability, for unit tests and throwaway runs."""

from __future__ import annotations

import asyncio
import copy
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any

from gateway.errors import LeaseLost, StaleRevision
from gateway.policy import PolicySpec
from gateway.store.base import (
    RESYNC,
    WINDOW_PAGE,
    AppliedIntent,
    AuditBounds,
    Event,
    EventDraft,
    Fence,
    Guard,
    PolicyScan,
    ReplicaReport,
    StoredPolicy,
    StoredRollout,
    new_generation,
)


def check_revision(kind: str, model: str, current: int, expected: int | None) -> None:
    if expected is not None and expected != current:
        raise StaleRevision(f"{kind} of model '{model}' is at revision {current}, not {expected}: "
                            "read it again and retry")


class InMemoryStore:
    def __init__(self, audit: AuditBounds | None = None) -> None:
        self.audit = audit or AuditBounds()
        self._generation = new_generation()
        self._policies: dict[str, StoredPolicy] = {}
        self._rollouts: dict[str, StoredRollout] = {}
        self._applied: dict[str, AppliedIntent] = {}
        self._events: deque[Event] = deque()
        self._event_seq = 0
        self._feeds: list[asyncio.Queue[str]] = []
        self._leases: dict[str, tuple[str, float]] = {}
        self._replicas: dict[str, tuple[ReplicaReport, float]] = {}  # id -> (report, expires)
        self._draining: dict[tuple[str, str], tuple[str, float]] = {}  # -> (drain id, expires)
        self._pins: dict[str, tuple[str, float]] = {}
        self._fenced: dict[str, tuple[str, float, int]] = {}  # name -> (holder, expires, epoch)
        self._loaded: dict[str, list[str]] = {}
        self._history: dict[str, dict[float, dict[str, Any]]] = {}  # model -> started_at -> document
        self._windows: deque[tuple[int, float, str, str]] = deque()  # (id, at, replica, payload)
        self._window_id = 0

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def generation(self) -> str:
        return self._generation

    async def get_policy(self, model: str) -> StoredPolicy | None:
        return self._policies.get(model)

    async def list_policies(self) -> dict[str, StoredPolicy]:
        return dict(self._policies)

    async def scan_policies(self) -> PolicyScan:
        return PolicyScan(self._generation, dict(self._policies), {})

    async def policy_mark(self) -> str | None:
        return None  # a scan is a dict copy: nothing to save by skipping it

    async def policies_since(self, mark: str) -> tuple[str, dict[str, StoredPolicy]] | None:
        return None

    async def put_policy(self, model: str, spec: PolicySpec | None, expected_revision: int | None,
                         event: EventDraft, guard: Guard | None = None) -> StoredPolicy:
        current = self._policies.get(model)
        check_revision("policy", model, current.revision if current else 0, expected_revision)
        self._check_guard(model, guard)
        stored = StoredPolicy(model, spec, (current.revision if current else 0) + 1, time.time(), self._generation,
                              event.actor)
        self._policies[model] = stored
        before = current.document() if current and current.spec else None
        await self.append_event(model, event.finish(model, before, stored.document() if spec else None))
        self._publish(model)
        return stored

    async def append_event(self, model: str, event: Event) -> None:
        self._event_seq += 1
        self._events.append(Event(**{**event.__dict__, "id": self._event_seq}))
        oldest = time.time() - self.audit.max_age_s
        while self._events and (len(self._events) > self.audit.max_events or self._events[0].at < oldest):
            self._events.popleft()  # the oldest first, as the durable stores trim

    async def events(self, model: str | None = None, limit: int = 100) -> list[Event]:
        chosen = [e for e in reversed(self._events) if model is None or e.model == model]
        return chosen[:limit]

    async def get_rollout(self, model: str) -> StoredRollout | None:
        return self._rollouts.get(model)

    async def list_rollouts(self) -> dict[str, StoredRollout]:
        return dict(self._rollouts)

    async def put_rollout(self, model: str, document: dict[str, Any], expected_revision: int | None,
                          guard: Guard | None = None) -> StoredRollout:
        current = self._rollouts.get(model)
        check_revision("rollout", model, current.revision if current else 0, expected_revision)
        self._check_guard(model, guard)
        stored = StoredRollout(model, document, (current.revision if current else 0) + 1)
        self._rollouts[model] = stored
        self._publish(model)
        return stored

    async def delete_rollout(self, model: str, expected_revision: int) -> None:
        current = self._rollouts.get(model)
        check_revision("rollout", model, current.revision if current else 0, expected_revision)
        self._rollouts.pop(model, None)
        self._publish(model)

    async def archive_rollout(self, model: str, document: dict[str, Any], keep: int) -> None:
        kept = self._history.setdefault(model, {})
        kept[float(document["started_at"])] = copy.deepcopy(document)
        for started_at in sorted(kept)[:-keep] if keep > 0 else list(kept):
            del kept[started_at]  # the oldest first

    async def rollout_history(self, model: str, limit: int) -> list[dict[str, Any]]:
        kept = self._history.get(model, {})
        return [copy.deepcopy(kept[at]) for at in sorted(kept, reverse=True)[:limit]]

    async def get_applied(self, model: str) -> AppliedIntent | None:
        return self._applied.get(model)

    async def set_applied(self, model: str, intent: AppliedIntent) -> None:
        self._applied[model] = intent

    async def changes(self) -> AsyncIterator[str]:
        queue: asyncio.Queue[str] = asyncio.Queue()
        self._feeds.append(queue)
        try:
            yield RESYNC
            while True:
                yield await queue.get()
        finally:
            self._feeds.remove(queue)

    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        now = time.monotonic()
        current = self._leases.get(name)
        if current is None or current[0] == holder or current[1] < now:
            self._leases[name] = (holder, now + ttl_s)
            return True
        return False

    async def release_lease(self, name: str, holder: str) -> None:
        if self._leases.get(name, ("", 0.0))[0] == holder:
            del self._leases[name]

    async def publish_windows(self, replica: str, payload: str, keep_s: float) -> None:
        now = time.monotonic()
        self._window_id += 1
        self._windows.append((self._window_id, now, replica, payload))
        while self._windows and self._windows[0][1] < now - keep_s:
            self._windows.popleft()

    async def read_windows(self, cursor: str) -> tuple[str, list[tuple[str, str]]]:
        after = int(cursor or 0)
        page = [entry for entry in self._windows if entry[0] > after][:WINDOW_PAGE]
        return (str(page[-1][0]) if page else str(after)), [(replica, payload) for _, _, replica, payload in page]

    async def report_replica(self, report: ReplicaReport, ttl_s: float) -> None:
        self._replicas[report.replica] = (report, time.monotonic() + ttl_s)

    async def live_replicas(self) -> list[ReplicaReport]:
        now = time.monotonic()
        return [report for report, expires in self._replicas.values() if expires > now]

    async def set_draining(self, model: str, version: str, drain_id: str | None, ttl_s: float = 0.0) -> None:
        if drain_id is None:
            self._draining.pop((model, version), None)
        else:
            self._draining[(model, version)] = (drain_id, time.monotonic() + ttl_s)

    async def draining(self) -> dict[tuple[str, str], str]:
        now = time.monotonic()
        return {key: drain_id for key, (drain_id, expires) in self._draining.items() if expires > now}

    async def save_pins(self, changes: Mapping[str, tuple[str, float] | None], idle_s: float) -> None:
        for key, entry in changes.items():
            if entry is None:
                self._pins.pop(key, None)
            else:
                self._pins[key] = entry

    async def load_pins(self, idle_s: float) -> dict[str, tuple[str, float]]:
        oldest = time.time() - idle_s
        return {key: entry for key, entry in self._pins.items() if entry[1] >= oldest}

    async def load_pin(self, key: str, idle_s: float) -> tuple[str, float] | None:
        entry = self._pins.get(key)
        return entry if entry is not None and entry[1] >= time.time() - idle_s else None

    def _publish(self, model: str) -> None:
        for queue in self._feeds:
            queue.put_nowait(model)

    # -- fencing ---------------------------------------------------------------------------
    async def acquire_fenced_lease(self, name: str, holder: str, ttl_s: float) -> int | None:
        fenced = self._fenced
        now = time.monotonic()
        current = fenced.get(name)
        if current is not None and current[0] == holder and current[1] >= now:
            fenced[name] = (holder, now + ttl_s, current[2])
            return current[2]
        if current is not None and current[1] >= now:
            return None
        epoch = (current[2] if current else 0) + 1
        fenced[name] = (holder, now + ttl_s, epoch)
        return epoch

    async def renew_fenced_lease(self, name: str, holder: str, epoch: int, ttl_s: float) -> bool:
        current = self._fenced.get(name)
        now = time.monotonic()
        if current is None or (current[0], current[2]) != (holder, epoch) or current[1] < now:
            return False
        self._fenced[name] = (holder, now + ttl_s, epoch)
        return True

    async def release_fenced_lease(self, name: str, holder: str, epoch: int) -> None:
        current = self._fenced.get(name)
        if current is not None and (current[0], current[2]) == (holder, epoch):
            self._fenced[name] = (holder, 0.0, epoch)  # expired: the epoch stays for the next taker

    def _check_fence(self, fence: Fence) -> None:
        current = self._fenced.get(fence.name)
        if current is None or (current[0], current[2]) != (fence.holder, fence.epoch):
            raise LeaseLost(fence_message(fence, current[2] if current else 0))

    def _check_guard(self, model: str, guard: Guard | None) -> None:
        if guard is not None:
            record = (self._policies if guard.kind == "policy" else self._rollouts).get(model)
            check_guard(model, guard, record.revision if record is not None else 0)

    async def put_policy_fenced(self, model: str, spec: PolicySpec | None, expected_revision: int | None,
                                event: EventDraft, fence: Fence, guard: Guard | None = None) -> StoredPolicy:
        self._check_fence(fence)  # no await before the write: atomic on the event loop
        return await self.put_policy(model, spec, expected_revision, event, guard)

    async def put_rollout_fenced(self, model: str, document: dict[str, Any], expected_revision: int | None,
                                 fence: Fence, guard: Guard | None = None) -> StoredRollout:
        self._check_fence(fence)
        return await self.put_rollout(model, document, expected_revision, guard)

    async def put_loaded_versions(self, model: str, versions: list[str]) -> None:
        self._loaded[model] = sorted(versions, key=int)

    async def loaded_versions(self) -> dict[str, list[str]]:
        return dict(self._loaded)


def check_guard(model: str, guard: Guard, current: int) -> None:
    if current != guard.revision:
        raise StaleRevision(f"the {guard.kind} of model '{model}' moved to revision {current} (from "
                            f"{guard.revision}) while this write was prepared: read both again and retry")


def fence_message(fence: Fence, current_epoch: int) -> str:
    return (f"lease '{fence.name}' epoch {fence.epoch} of {fence.holder} is no longer current "
            f"(now {current_epoch}): this replica was deposed, its write is refused")
