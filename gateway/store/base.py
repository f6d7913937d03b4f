"""The state store: durable routing state shared by every replica.

One :class:`StateStore` protocol, three backends chosen by URL scheme in :func:`make_store`:
``memory://`` (tests), ``sqlite:///path`` (the embedded default, WAL, durable before the API
answers) and ``redis://host:port/db`` (replicas: pub/sub change feed plus periodic resync).
An unknown scheme fails at start; it never falls back silently.

Revisions are per model and only grow: a delete leaves a tombstone with the next revision,
so compare-and-set and replica catch-up stay correct across delete and re-create.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.errors import StaleRevision
from gateway.policy import PolicySpec


@dataclass(frozen=True)
class StoredPolicy:
    model: str
    spec: PolicySpec | None  # None: deleted (tombstone), the model is back to passthrough
    revision: int
    updated_at: float

    def document(self) -> dict[str, Any]:
        doc = self.spec.document() if self.spec else {"weights": {}, "sticky_header": None, "rules": []}
        return {"model": self.model, **doc, "revision": self.revision, "updated_at": self.updated_at}


@dataclass(frozen=True)
class Event:
    """One line of the audit trail."""

    at: float
    actor: str
    action: str
    model: str
    before: Any = None
    after: Any = None
    reason: str | None = None
    id: int = 0

    def document(self) -> dict[str, Any]:
        return {"id": self.id, "at": self.at, "actor": self.actor, "action": self.action, "model": self.model,
                "before": self.before, "after": self.after, "reason": self.reason}


@dataclass(frozen=True)
class StoredRollout:
    """A rollout document (owned by gateway.rollout) with its own CAS revision."""

    model: str
    document: dict[str, Any]
    revision: int


@dataclass
class EventDraft:
    actor: str
    action: str
    reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def finish(self, model: str, before: Any, after: Any) -> Event:
        return Event(at=time.time(), actor=self.actor, action=self.action, model=model, before=before,
                     after=after, reason=self.reason)


class StateStore(Protocol):
    async def open(self) -> None:
        """Connect / create tables. Raises StoreError if the backend cannot be used."""

    async def close(self) -> None:
        """Release connections; pending writes are already durable."""

    async def get_policy(self, model: str) -> StoredPolicy | None:
        """The model's policy record, tombstones included; None if it never had one."""

    async def list_policies(self) -> dict[str, StoredPolicy]:
        """Every policy record, tombstones included."""

    async def put_policy(self, model: str, spec: PolicySpec | None, expected_revision: int | None,
                         event: EventDraft) -> StoredPolicy:
        """Compare-and-set: write ``spec`` (None deletes) as revision+1 and append the event,
        atomically and durably. ``expected_revision`` None skips the check; a mismatch raises
        StaleRevision and changes nothing."""

    async def seed_policy(self, model: str, spec: PolicySpec, actor: str) -> bool:
        """Write ``spec`` only if the model never had a policy record. True if written."""

    async def append_event(self, model: str, event: Event) -> None:
        """Append one audit event."""

    async def events(self, model: str | None = None, limit: int = 100) -> list[Event]:
        """Newest first."""

    async def get_rollout(self, model: str) -> StoredRollout | None:
        """The model's rollout record, or None."""

    async def list_rollouts(self) -> dict[str, StoredRollout]:
        """Every rollout record."""

    async def put_rollout(self, model: str, document: dict[str, Any], expected_revision: int | None) -> StoredRollout:
        """Compare-and-set a rollout document (revision+1); StaleRevision on mismatch."""

    def changes(self) -> AsyncIterator[str]:
        """Model names whose records changed, as soon as the backend can tell (may repeat,
        may miss under failure: callers also resync periodically)."""

    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        """Take or renew the lease ``name`` for ``holder``; True while held."""


async def seed_once(store: StateStore, model: str, spec: PolicySpec, actor: str) -> bool:
    """The shared seed_policy(): write only if the model never had a record (revision 0)."""
    try:
        await store.put_policy(model, spec, 0, EventDraft(actor, "seed", "static policy from the settings"))
    except StaleRevision:  # the model already has a record: API changes win over the file
        return False
    return True


def make_store(url: str) -> StateStore:
    """Backend by URL scheme: memory://, sqlite:///path, redis://host:port/db."""
    if url.startswith("memory://"):
        from gateway.store.memory import InMemoryStore

        return InMemoryStore()
    if url.startswith("sqlite://"):
        from gateway.store.sqlite import SQLiteStore

        return SQLiteStore(url.removeprefix("sqlite://").removeprefix("/") or "gateway-state.db")
    if url.startswith(("redis://", "rediss://", "unix://")):
        from gateway.store.redis import RedisStore

        return RedisStore(url)
    raise ValueError(f"unknown store URL scheme in {url!r}: use sqlite:///path, redis://host:port/db or memory://")
