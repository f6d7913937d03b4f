"""The config file's ``policies:`` as declared intent, applied the way ``kubectl apply`` does.

The store keeps, per model, a digest of the policy last applied from the file. At start:

- a file entry that changed since it was last applied (or that the store has never seen)
  is applied as a new revision, audited as actor ``config``;
- a file entry that did not change leaves the store alone, so changes made through the
  API (or by a rollout) since survive a restart;
- the first start of a version that keeps digests, over a store with history, takes the
  store as it is and remembers the file entry as applied: editing the entry applies it.

One log line per model says which of these happened (with the revision, who wrote it and
when), so a restart never silently ignores the file, nor silently overrides an SRE.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import time
from collections.abc import Mapping

from gateway.errors import CorruptRecord, StaleRevision
from gateway.policy import PolicySpec
from gateway.store.base import AppliedIntent, EventDraft, StateStore, StoredPolicy

log = logging.getLogger("gateway.config")
ACTOR = "config"
ATTEMPTS = 3  # replicas starting together race on the same write: the loser reads again


def digest(spec: PolicySpec) -> str:
    return hashlib.sha256(json.dumps(spec.document(), sort_keys=True).encode()).hexdigest()


async def apply_declared(store: StateStore, declared: Mapping[str, PolicySpec]) -> dict[str, str]:
    """Reconcile the store with the file; model -> what happened ('applied', 'kept', 'differ')."""
    outcome = {}
    for model in sorted(declared):
        for attempt in range(ATTEMPTS):
            try:
                outcome[model] = await _reconcile(store, model, declared[model])
                break
            except StaleRevision:
                if attempt == ATTEMPTS - 1:
                    raise
    return outcome


async def _reconcile(store: StateStore, model: str, spec: PolicySpec) -> str:
    wanted = digest(spec)
    applied = await store.get_applied(model)
    try:
        current = await store.get_policy(model)
        unreadable = False
    except CorruptRecord:
        current, unreadable = None, True
    same = current is not None and current.spec is not None and current.spec.document() == spec.document()
    if applied is not None and applied.digest == wanted:
        return _kept(model, current, same, unreadable, "changed since the file entry was applied")
    if current is not None and (same or applied is None):
        # The file entry matches the store, or this is the first start that keeps digests
        # over a store with history (an upgrade): remember it as applied, change nothing.
        await store.set_applied(model, AppliedIntent(wanted, current.revision, time.time()))
        return _kept(model, current, same, unreadable, "the file entry was never applied by a gateway that "
                     "keeps track: edit it to apply it")
    reason = "new in the config file" if applied is None else "the config file entry changed since it was last applied"
    expected = None if unreadable else (current.revision if current is not None else 0)
    stored = await store.put_policy(model, spec, expected, EventDraft(ACTOR, "apply_config", reason))
    await store.set_applied(model, AppliedIntent(wanted, stored.revision, stored.updated_at))
    log.info("policy of %s: applied from the config file as revision %d (%s)", model, stored.revision, reason)
    return "applied"


def _kept(model: str, current: StoredPolicy | None, same: bool, unreadable: bool, why: str) -> str:
    if unreadable:
        log.warning("policy of %s: the stored record cannot be read and the config file entry did not change: "
                    "kept as it is (PUT a policy, or edit the file entry, to replace it)", model)
        return "differ"
    assert current is not None
    written = (f"revision {current.revision} by {current.actor or 'an unknown actor'} at "
               f"{dt.datetime.fromtimestamp(current.updated_at, dt.UTC).isoformat(timespec='seconds')}")
    if same:
        log.info("policy of %s: kept from the store, %s (the same as the config file)", model, written)
        return "kept"
    state = "deleted" if current.spec is None else "a different policy"
    log.warning("policy of %s: the config file and the store differ: kept the store's %s, %s (%s)",
                model, state, written, why)
    return "differ"
