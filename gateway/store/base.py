"""The state store: durable routing state shared by every replica.

One :class:`StateStore` protocol, three backends chosen by URL scheme in :func:`make_store`:
``memory://`` (tests), ``sqlite:///path`` (the embedded default, WAL, durable before the API
answers) and ``redis://host:port/db`` (replicas: pub/sub change feed plus periodic resync).
An unknown scheme fails at start; it never falls back silently.

Revisions are per model and only grow: a delete leaves a tombstone with the next revision,
so compare-and-set and replica catch-up stay correct across delete and re-create. They only
grow *within one generation*: every store has a generation id, made when the store is
created empty, and a wiped or replaced store (Redis FLUSHALL, a failover to an empty
replica, a new database file) has a new one, so replicas know to rebuild from it rather
than ignore its "old" revisions.

Stored records are read leniently (a field this version does not know is ignored with one
warning: a newer replica may have written it during a rolling upgrade) while the admin API
stays strict; a record that cannot be read at all is reported, never fatal to the caller.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.policy import PolicySpec
from gateway.store.changes import changes

WINDOW_PAGE = 1000  # replicas' window reports read at once (gateway.services.replica_windows)
RESYNC = "*"  # on the change feed: anything may have changed (feed (re)connected): resync everything


def new_generation() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Fence:
    """Proof of holding lease ``name``: the epoch :meth:`StateStore.acquire_fenced_lease` returned.
    The epoch grows every time the lease is taken anew, so a deposed holder's epoch is stale."""

    name: str
    holder: str
    epoch: int


@dataclass(frozen=True)
class Guard:
    """A second compare-and-set, checked atomically with a write: the model's ``kind`` record
    (``"policy"`` or ``"rollout"``) must still be at ``revision`` (0: no record), else the write
    raises StaleRevision and changes nothing. It ties a model's two records together: a rollout
    announces the policy revision it is about to write only while the policy is still the one
    it read, and the policy write lands only while that announcement is the newest rollout
    record, so an admin command and a controller tick can never interleave into a lost write."""

    kind: str
    revision: int


@dataclass(frozen=True)
class StoredPolicy:
    model: str
    spec: PolicySpec | None  # None: deleted (tombstone), the model is back to passthrough
    revision: int
    updated_at: float
    generation: str = ""  # of the store it was read from (or written to)
    actor: str = ""  # who wrote this revision (empty for records written before it was kept)

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
        """With ``changes``: what differs between before and after, field by field (store.changes)."""
        return {"id": self.id, "at": self.at, "actor": self.actor, "action": self.action, "model": self.model,
                "before": self.before, "after": self.after, "reason": self.reason,
                "changes": changes(self.before, self.after)}


@dataclass(frozen=True)
class PolicyScan:
    """Every policy record of one store generation: the readable ones, and the ones that
    are not (model -> why), which callers must leave alone rather than treat as deleted."""

    generation: str
    policies: dict[str, StoredPolicy]
    corrupt: dict[str, str]


@dataclass(frozen=True)
class AppliedIntent:
    """The last policy applied from the config file for a model (kubectl's last-applied)."""

    digest: str
    revision: int
    at: float


@dataclass(frozen=True)
class AuditBounds:
    """How much audit trail a store keeps: the newest ``max_events``, none older than ``max_age_s``."""

    max_events: int = 100_000
    max_age_s: float = 365 * 86400.0


@dataclass(frozen=True)
class ReplicaReport:
    """What one replica says about itself, refreshed while it lives (it expires when it stops):
    for every version being drained, its requests in flight and sequences pinned to it, and
    which drain it is answering (so an old report never counts for a new drain)."""

    replica: str
    at: float
    usage: dict[str, tuple[int, int, str]]  # "model/version" -> (in flight, pinned sequences, drain id)

    def document(self) -> dict[str, Any]:
        return {"replica": self.replica, "at": self.at, "usage": {k: list(v) for k, v in self.usage.items()}}

    @staticmethod
    def from_document(doc: Any) -> ReplicaReport | None:
        try:
            usage = {str(k): (int(v[0]), int(v[1]), str(v[2])) for k, v in doc["usage"].items()}
            return ReplicaReport(str(doc["replica"]), float(doc["at"]), usage)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):
            return None  # an unreadable report: as if that replica had not reported


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

    async def generation(self) -> str:
        """This store's generation id (made on first use of an empty store)."""

    async def get_policy(self, model: str) -> StoredPolicy | None:
        """The model's policy record, tombstones included; None if it never had one.
        CorruptRecord if the record cannot be read."""

    async def list_policies(self) -> dict[str, StoredPolicy]:
        """Every readable policy record, tombstones included (unreadable ones are left out)."""

    async def scan_policies(self) -> PolicyScan:
        """Every policy record with the store's generation, unreadable records named apart."""

    async def policy_mark(self) -> str | None:
        """A value that changes whenever any policy record is written, by any process (and with
        the generation), or None when the backend cannot tell: a periodic resync that finds the
        mark where its last full read left it has nothing to read (gateway.services.state_sync)."""

    async def policies_since(self, mark: str) -> tuple[str, dict[str, StoredPolicy]] | None:
        """The policy records written since ``mark`` (a :meth:`policy_mark`), and the mark now;
        None when the backend cannot tell which they are (the caller reads them all)."""

    async def put_policy(self, model: str, spec: PolicySpec | None, expected_revision: int | None,
                         event: EventDraft, guard: Guard | None = None) -> StoredPolicy:
        """Compare-and-set: write ``spec`` (None deletes) as revision+1 and append the event,
        atomically and durably. ``expected_revision`` None skips the check; a mismatch (or a
        ``guard`` that does not hold) raises StaleRevision and changes nothing."""

    async def append_event(self, model: str, event: Event) -> None:
        """Append one audit event."""

    async def events(self, model: str | None = None, limit: int = 100) -> list[Event]:
        """Newest first."""

    async def get_rollout(self, model: str) -> StoredRollout | None:
        """The model's rollout record, or None."""

    async def list_rollouts(self) -> dict[str, StoredRollout]:
        """Every rollout record."""

    async def put_rollout(self, model: str, document: dict[str, Any], expected_revision: int | None,
                          guard: Guard | None = None) -> StoredRollout:
        """Compare-and-set a rollout document (revision+1); StaleRevision on mismatch (or when
        ``guard`` does not hold)."""

    async def delete_rollout(self, model: str, expected_revision: int) -> None:
        """Remove the model's rollout record if it is still at ``expected_revision``
        (undoes a record whose rollout could not start); StaleRevision otherwise."""

    # -- finished rollouts, kept after a new rollout replaces the record ------------------------
    async def archive_rollout(self, model: str, document: dict[str, Any], keep: int) -> None:
        """Keep a finished rollout's document in the model's history, under its ``started_at``
        (archiving the same rollout again replaces it); only the newest ``keep`` stay."""

    async def rollout_history(self, model: str, limit: int) -> list[dict[str, Any]]:
        """The model's archived rollouts, newest (by ``started_at``) first, at most ``limit``."""

    async def get_applied(self, model: str) -> AppliedIntent | None:
        """What the config file last applied for the model, if anything."""

    async def set_applied(self, model: str, intent: AppliedIntent) -> None:
        """Remember what the config file applied for the model."""

    def changes(self) -> AsyncIterator[str]:
        """Model names whose records changed, as soon as the backend can tell (may repeat).

        :data:`RESYNC` first, once the feed is live, and again after every reconnect: the
        caller then resyncs everything, so no change made while the feed was down is lost.
        Raises StoreError when the backend is unreachable; the caller calls again."""

    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        """Take or renew the lease ``name`` for ``holder``; True while held."""

    async def release_lease(self, name: str, holder: str) -> None:
        """Give the lease up, if ``holder`` still has it."""

    # -- fencing (the rollout controller's writes) -------------------------------------------
    async def acquire_fenced_lease(self, name: str, holder: str, ttl_s: float) -> int | None:
        """Take or renew the fenced lease ``name``: its epoch while ``holder`` holds it, else None.
        Renewing keeps the epoch; taking it anew (first time, after expiry, from another holder)
        gives the previous epoch + 1, durably, so epochs never repeat for a name."""

    async def renew_fenced_lease(self, name: str, holder: str, epoch: int, ttl_s: float) -> bool:
        """Extend the fenced lease ``name`` by ``ttl_s`` only if ``holder`` holds it at ``epoch`` and
        it has not expired; False (nothing changes) otherwise: a holder that lost its lease
        never takes it back by renewing, so another replica can take it over."""

    async def release_fenced_lease(self, name: str, holder: str, epoch: int) -> None:
        """Give the fenced lease up now, if ``holder`` holds it at ``epoch`` (a graceful stop: the
        next replica takes it without waiting out the TTL). The epoch record stays."""

    # -- replicas' rollout windows (gateway.services.replica_windows) ---------------------------
    async def publish_windows(self, replica: str, payload: str, keep_s: float) -> None:
        """Append one replica's report; reports older than ``keep_s`` may be dropped from now on."""

    async def read_windows(self, cursor: str) -> tuple[str, list[tuple[str, str]]]:
        """Reports appended after ``cursor`` ("" : the oldest kept), in order, at most a page of
        them: (the cursor after them, [(replica, payload)]). Empty once the reader is caught up."""

    async def put_policy_fenced(self, model: str, spec: PolicySpec | None, expected_revision: int | None,
                                event: EventDraft, fence: Fence, guard: Guard | None = None) -> StoredPolicy:
        """:meth:`put_policy`, done only if ``fence`` is still the lease's current holder and epoch,
        checked atomically with the write; LeaseLost otherwise (nothing changes)."""

    async def put_rollout_fenced(self, model: str, document: dict[str, Any], expected_revision: int | None,
                                 fence: Fence, guard: Guard | None = None) -> StoredRollout:
        """:meth:`put_rollout`, fenced like :meth:`put_policy_fenced`."""

    # -- the versions the gateway wants loaded, restored after a Triton restart ----------------
    async def put_loaded_versions(self, model: str, versions: list[str]) -> None:
        """Record the versions of ``model`` the gateway wants loaded (after a load or unload)."""

    async def loaded_versions(self) -> dict[str, list[str]]:
        """Every model's recorded set of versions to keep loaded."""


    async def report_replica(self, report: ReplicaReport, ttl_s: float) -> None:
        """Publish this replica's report; it disappears ``ttl_s`` after the last one."""

    async def live_replicas(self) -> list[ReplicaReport]:
        """The latest report of every replica whose report has not expired."""

    async def set_draining(self, model: str, version: str, drain_id: str | None, ttl_s: float = 0.0) -> None:
        """Mark (``drain_id``) or unmark (None) a version as draining; a mark expires after ``ttl_s``."""

    async def draining(self) -> dict[tuple[str, str], str]:
        """Versions being drained now: (model, version) -> drain id."""

    async def save_pins(self, changes: Mapping[str, tuple[str, float] | None], idle_s: float) -> None:
        """Sequence pins by key: (version, wall time of last use), or None to forget one.
        A pin not saved again within ``idle_s`` of its last use expires."""

    async def load_pins(self, idle_s: float) -> dict[str, tuple[str, float]]:
        """Every pin used within ``idle_s``: key -> (version, wall time of last use)."""

    async def load_pin(self, key: str, idle_s: float) -> tuple[str, float] | None:
        """One pin, if it was used within ``idle_s`` (another replica's sequence, read on a miss)."""


def make_store(url: str, audit: AuditBounds | None = None) -> StateStore:
    """Backend by URL scheme: memory://, sqlite:///path, redis://host:port/db."""
    audit = audit or AuditBounds()
    if url.startswith("memory://"):
        from gateway.store.memory import InMemoryStore

        return InMemoryStore(audit)
    if url.startswith("sqlite://"):
        from gateway.store.sqlite import SQLiteStore

        return SQLiteStore(url.removeprefix("sqlite://").removeprefix("/") or "gateway-state.db", audit=audit)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from gateway.store.redis import RedisStore

        return RedisStore(url, audit=audit)
    raise ValueError(f"unknown store URL scheme in {url!r}: use sqlite:///path, redis://host:port/db or memory://")
