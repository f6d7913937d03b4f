"""Finished rollouts, kept after the next rollout of the model replaces the record.

A rollout is archived (:meth:`StateStore.archive_rollout`) when it reaches a final phase, and
again (the same entry, by its ``started_at``) when a new rollout replaces its record, so a
failed archive write is made good before anything is lost. The archived copy carries the
verdicts and the judge's evidence as the record held them, with webhook secrets taken out
(a reader of the history may not sign as the gateway, and nothing needs them any more).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from gateway.errors import GatewayError
from gateway.rollout.phases import Phase
from gateway.store.base import StateStore

log = logging.getLogger("gateway.rollout")
KEEP_PER_MODEL = 20  # the default of settings.rollout_history_per_model


def redacted(document: dict[str, Any]) -> dict[str, Any]:
    """A copy of a rollout document with every webhook secret shown as ``***``."""
    doc = copy.deepcopy(document)
    for hook in (doc.get("spec") or {}).get("webhooks") or []:
        if hook.get("secret") is not None:
            hook["secret"] = "***"
    return doc


def finished(document: dict[str, Any]) -> bool:
    return not Phase(document["state"]).active


async def archive(store: StateStore, document: dict[str, Any], keep: int) -> None:
    """Keep a finished rollout (a store failure is logged: the record still holds it, and the
    next rollout's start archives it again before replacing it)."""
    try:
        await store.archive_rollout(document["model"], redacted(document), keep)
    except GatewayError as exc:
        log.warning("rollout of %s: not archived yet (%s): kept in its record until the next rollout starts",
                    document["model"], exc)


async def finished_rollouts(store: StateStore, model: str, limit: int) -> list[dict[str, Any]]:
    """The model's finished rollouts, newest first: its record when that one has ended (the
    freshest copy), then the archived ones."""
    listed: dict[float, dict[str, Any]] = {}
    current = await store.get_rollout(model)
    if current is not None and finished(current.document):
        listed[float(current.document["started_at"])] = redacted(current.document)
    for document in await store.rollout_history(model, limit):
        listed.setdefault(float(document["started_at"]), document)
    return [listed[at] for at in sorted(listed, reverse=True)[:limit]]
