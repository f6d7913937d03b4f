"""Applying policy changes: validate against Triton, compare-and-set in the store, audit,
then swap the local policy book. Used by the admin API and the rollout controller alike.

Order matters: nothing is written unless every check passed, and the book changes only
after the store accepted the change, so an invalid request changes nothing anywhere.
"""

from __future__ import annotations

import json
import logging
import time

from gateway.errors import NotFound
from gateway.policy import PolicySpec
from gateway.policy_book import PolicyBook
from gateway.services.triton_control import TritonControl
from gateway.store.base import Event, EventDraft, StateStore, StoredPolicy

log = logging.getLogger("gateway.admin")


class PolicyService:
    def __init__(self, store: StateStore, book: PolicyBook, triton: TritonControl) -> None:
        self.store = store
        self.book = book
        self.triton = triton

    async def get(self, model: str) -> StoredPolicy:
        stored = await self.store.get_policy(model)
        if stored is None or stored.spec is None:
            raise NotFound(f"model '{model}' has no routing policy (requests go to Triton's default version)")
        return stored

    async def put(self, model: str, spec: PolicySpec, expected_revision: int | None, event: EventDraft,
                  require_ready: bool = True) -> StoredPolicy:
        """``require_ready=False`` only for rollbacks: moving traffic *away* from a broken
        version must never wait on that version's health."""
        if require_ready:
            await self.triton.require_ready(model, spec.versions())
        stored = await self.store.put_policy(model, spec, expected_revision, event)
        self.apply(stored)
        _log_change(stored.model, stored.revision, event, spec.document())
        return stored

    async def set_weights(self, model: str, weights: dict[str, object], expected_revision: int | None,
                          event: EventDraft) -> StoredPolicy:
        current = await self.get(model)
        if expected_revision is None:
            expected_revision = current.revision  # protect our own read-modify-write
        assert current.spec is not None
        spec = PolicySpec.model_validate({**current.spec.document(), "weights": weights})
        return await self.put(model, spec, expected_revision, event)

    async def delete(self, model: str, expected_revision: int | None, event: EventDraft) -> StoredPolicy:
        current = await self.get(model)
        stored = await self.store.put_policy(model, None, expected_revision or current.revision, event)
        self.apply(stored)
        _log_change(stored.model, stored.revision, event, None)
        return stored

    async def audit(self, model: str, actor: str, action: str, reason: str, at: float | None = None) -> None:
        """An audit-trail line for something that is not itself a policy write."""
        await self.store.append_event(model, Event(at=time.time() if at is None else at, actor=actor, action=action,
                                                   model=model, reason=reason))

    def apply(self, stored: StoredPolicy) -> None:
        """Bring the local book to a stored record (newer revisions only)."""
        if stored.spec is None:
            self.book.remove(stored.model, stored.revision)
        else:
            self.book.put(stored.model, stored.spec, stored.revision)


def _log_change(model: str, revision: int, event: EventDraft, policy: object) -> None:
    log.info(json.dumps({"type": "admin", "actor": event.actor, "action": event.action, "model": model,
                         "revision": revision, "reason": event.reason, "policy": policy}, default=str))
