"""In-process store: the contract without durability, for unit tests and throwaway runs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from gateway.errors import StaleRevision
from gateway.policy import PolicySpec
from gateway.store.base import Event, EventDraft, StoredPolicy, StoredRollout, seed_once


def check_revision(kind: str, model: str, current: int, expected: int | None) -> None:
    if expected is not None and expected != current:
        raise StaleRevision(f"{kind} of model '{model}' is at revision {current}, not {expected}: "
                            "read it again and retry")


class InMemoryStore:
    def __init__(self) -> None:
        self._policies: dict[str, StoredPolicy] = {}
        self._rollouts: dict[str, StoredRollout] = {}
        self._events: list[Event] = []
        self._feeds: list[asyncio.Queue[str]] = []
        self._leases: dict[str, tuple[str, float]] = {}

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def get_policy(self, model: str) -> StoredPolicy | None:
        return self._policies.get(model)

    async def list_policies(self) -> dict[str, StoredPolicy]:
        return dict(self._policies)

    async def put_policy(self, model: str, spec: PolicySpec | None, expected_revision: int | None,
                         event: EventDraft) -> StoredPolicy:
        current = self._policies.get(model)
        check_revision("policy", model, current.revision if current else 0, expected_revision)
        stored = StoredPolicy(model, spec, (current.revision if current else 0) + 1, time.time())
        self._policies[model] = stored
        before = current.document() if current and current.spec else None
        await self.append_event(model, event.finish(model, before, stored.document() if spec else None))
        self._publish(model)
        return stored

    async def seed_policy(self, model: str, spec: PolicySpec, actor: str) -> bool:
        return await seed_once(self, model, spec, actor)

    async def append_event(self, model: str, event: Event) -> None:
        self._events.append(Event(**{**event.__dict__, "id": len(self._events) + 1}))

    async def events(self, model: str | None = None, limit: int = 100) -> list[Event]:
        chosen = [e for e in reversed(self._events) if model is None or e.model == model]
        return chosen[:limit]

    async def get_rollout(self, model: str) -> StoredRollout | None:
        return self._rollouts.get(model)

    async def list_rollouts(self) -> dict[str, StoredRollout]:
        return dict(self._rollouts)

    async def put_rollout(self, model: str, document: dict[str, Any], expected_revision: int | None) -> StoredRollout:
        current = self._rollouts.get(model)
        check_revision("rollout", model, current.revision if current else 0, expected_revision)
        stored = StoredRollout(model, document, (current.revision if current else 0) + 1)
        self._rollouts[model] = stored
        self._publish(model)
        return stored

    async def changes(self) -> AsyncIterator[str]:
        queue: asyncio.Queue[str] = asyncio.Queue()
        self._feeds.append(queue)
        try:
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

    def _publish(self, model: str) -> None:
        for queue in self._feeds:
            queue.put_nowait(model)
