"""Applying policy changes: validate against Triton, compare-and-set in the store, audit,
then swap the local policy book. Used by the admin API and the rollout controller alike.

Order matters: nothing is written unless every check passed, and the book changes only
after the store accepted the change, so an invalid request changes nothing anywhere.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from gateway.errors import BadRequest, NotFound
from gateway.policy import PolicySpec, own_model_twice, with_weights
from gateway.policy_book import PolicyBook
from gateway.services.triton_control import TritonControl
from gateway.store.base import Event, EventDraft, StateStore, StoredPolicy

log = logging.getLogger("gateway.admin")


class PolicyService:
    """The one way a policy changes: checked against Triton, written to the store, applied to the book."""

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
        clash = own_model_twice(model, spec)
        if clash is not None:
            raise BadRequest(clash)
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
        return await self.put(model, with_weights(current.spec, weights), expected_revision, event)

    async def delete(self, model: str, expected_revision: int | None, event: EventDraft) -> StoredPolicy:
        current = await self.get(model)
        expected = current.revision if expected_revision is None else expected_revision  # If-Match: "0" is checked too
        stored = await self.store.put_policy(model, None, expected, event)
        self.apply(stored)
        _log_change(stored.model, stored.revision, event, None)
        return stored

    async def models(self) -> list[dict[str, Any]]:
        """Every model Triton knows with each version's state, its policy (if any), and the drift its
        rollout last found (servers of a fleet serving its canary with another config: rollout.engine)."""
        index = await self.triton.index()
        stored = await self.store.list_policies()
        changed = await self.store.loaded_versions()  # the gateway's own loads ("3") and unloads ("-3")
        rollouts = await self.store.list_rollouts()
        drift = {name: record.document.get("drift") or [] for name, record in rollouts.items()}
        models: dict[str, dict[str, Any]] = {}
        for entry in index:
            model = models.setdefault(entry["name"], {"name": entry["name"], "versions": [], "policy": None,
                                                      "drift": drift.get(entry["name"], [])})
            if "version" in entry:
                version = str(entry["version"])
                mine = changed.get(entry["name"], [])
                by_gateway = version in mine or f"-{version}" in mine
                # "gateway": loaded or unloaded through the gateway (restored after a Triton restart);
                # "triton": as Triton's own port or config.pbtxt left it (the gateway leaves it alone)
                model["versions"].append({"version": version, "state": entry.get("state", "UNKNOWN"),
                                          "reason": entry.get("reason", ""),
                                          "managed_by": "gateway" if by_gateway else "triton"})
        for name, record in stored.items():
            if record.spec is not None:
                models.setdefault(name, {"name": name, "versions": [], "policy": None,
                                         "drift": drift.get(name, [])})["policy"] = record.document()
        return sorted(models.values(), key=lambda m: m["name"])

    async def events(self, model: str | None, limit: int) -> list[Event]:
        """The audit trail, newest first."""
        return await self.store.events(model, limit)

    async def audit(self, model: str, actor: str, action: str, reason: str, at: float | None = None) -> None:
        """An audit-trail line for something that is not itself a policy write."""
        await self.store.append_event(model, Event(at=time.time() if at is None else at, actor=actor, action=action,
                                                   model=model, reason=reason))

    def apply(self, stored: StoredPolicy, force: bool = False) -> None:
        """Bring the local book to a stored record: newer revisions only, unless the record
        comes from a store generation the book was not built from (a wiped store starts
        again at revision 1: its records are news however small their revisions)."""
        force = force or stored.generation != self.book.generation
        if stored.spec is None:
            self.book.remove(stored.model, stored.revision, force=force)
        else:
            self.book.put(stored.model, stored.spec, stored.revision, force=force)


def _log_change(model: str, revision: int, event: EventDraft, policy: object) -> None:
    log.info(json.dumps({"type": "admin", "actor": event.actor, "action": event.action, "model": model,
                         "revision": revision, "reason": event.reason, "policy": policy}, default=str))
