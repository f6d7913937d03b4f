"""Zero-downtime version lifecycle: load a version beside the serving ones; drain, then unload.

Triton loads and unloads whole models; a version-level change is a reload with a
``version_policy`` override naming the versions to keep. Triton's reload is atomic: a
version that fails to initialise leaves the old ones serving. Unloading first *drains*:
the version leaves every policy, then we wait until no replica has a request in flight to
it or an open sequence pinned to it (see :mod:`gateway.services.replicas`), and only then ask
Triton to drop it. Reloads of a model are serialised across replicas by a store lease.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from gateway.errors import Conflict, LoadFailed, NotFound
from gateway.policy import parse_target, without_version
from gateway.services.policies import PolicyService
from gateway.services.replicas import Replicas
from gateway.services.triton_control import TritonControl, restore_target, with_change
from gateway.store.base import EventDraft, StateStore

log = logging.getLogger("gateway.lifecycle")
RESTORE_GRACE_S = 2.0
RESTORE_LOCK_WAIT_S = 0.5  # restore runs inside a controller tick: never wait long for the lease


class ModelLifecycle:
    def __init__(self, store: StateStore, triton: TritonControl, policies: PolicyService, replicas: Replicas,
                 load_timeout_s: float = 300.0, drain_timeout_s: float = 60.0) -> None:
        self.store = store
        self.triton = triton
        self.policies = policies
        self.replicas = replicas
        self.load_timeout_s = load_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self._mismatch_since: dict[str, tuple[frozenset[str], float]] = {}  # model -> (READY set, first seen)

    async def serving(self, model: str) -> set[str]:
        return {v for v, state in (await self.triton.versions(model)).items() if state.state == "READY"}

    async def load(self, model: str, version: str, actor: str, config: dict[str, Any] | None = None) -> dict[str, Any]:
        """``config``: a model configuration the admin gives for the load; the answer's ``config_sent``
        says what Triton was sent (:meth:`TritonControl.plan`)."""
        async with self.replicas.lock(model, self.load_timeout_s):
            serving = await self.serving(model)
            if version in serving and config is None:
                return {"model": model, "version": version, "state": "READY", "serving": sorted(serving, key=int)}
            keep = serving | {version}
            sent = await self.triton.reload(model, keep, self.load_timeout_s, config)
            await self._record(model, loaded=[version])  # restored after a Triton restart
            states = await self.triton.versions(model)
            state = states.get(version)
            if state is None or state.state != "READY":
                why = state.reason if state else "not in the repository index"
                raise LoadFailed(f"version {version} of model '{model}' did not become READY: {why}")
        await self._event(model, actor, "version_loaded", f"version {version} loaded beside {sorted(serving)}")
        return {"model": model, "version": version, "state": "READY", "serving": sorted(keep, key=int),
                "config_sent": sent}

    async def unload(self, model: str, version: str, actor: str) -> dict[str, Any]:
        drains, sent = await self.unload_versions(model, [version], actor)
        return {"model": model, "version": version, "state": "UNLOADED", "drain": drains[version], "config_sent": sent}

    async def unload_versions(self, model: str, versions: list[str], actor: str) -> tuple[dict[str, str], str]:
        """Drain every one of ``versions`` (together), then unload them all with **one** reload:
        each reload of a Python-backend model restarts its stubs, and back-to-back reloads (one per
        version, as promotion cleanup made them) were followed by a Triton crash
        (``boost::interprocess::lock_exception``) in one run of four. Returns each version's drain,
        and what Triton was sent."""
        serving = await self.serving(model)
        for version in versions:
            if version not in serving:
                raise NotFound(f"version {version} of model '{model}' is not loaded")
        if not serving - set(versions):
            named = f"version {versions[0]} is the only version" if len(versions) == 1 else \
                f"versions {sorted(versions, key=int)} are the only versions"
            raise Conflict(f"{named} of model '{model}' serving: load another first")
        for version in versions:
            await self._refuse_if_referenced(model, version)
        for version in versions:
            await self._take_out_of_policy(model, version, actor)
        drains = await asyncio.gather(*(self.replicas.drain(model, version, self.drain_timeout_s)
                                        for version in versions))
        async with self.replicas.lock(model, self.load_timeout_s):
            keep = await self.serving(model) - set(versions)
            sent = await self._reload(model, keep, self.load_timeout_s)
            await self._record(model, unloaded=list(versions))
        for version, drained in zip(versions, drains, strict=True):
            await self._event(model, actor, "version_unloaded", f"version {version} drained ({drained}) and unloaded")
        return dict(zip(versions, drains, strict=True)), sent

    async def _refuse_if_referenced(self, model: str, version: str) -> None:
        """409 naming what still needs the version: an active rollout (its stable is the rollback
        target, its canary takes traffic) or a non-zero weight."""
        rollout = await self.store.get_rollout(model)
        if rollout is not None and rollout.document["state"] in ("progressing", "paused", "rolling_back"):
            for role in ("stable", "canary", "baseline"):
                if rollout.document.get(role) == version:
                    raise Conflict(f"version {version} of model '{model}' is the {role} of its "
                                   f"{rollout.document['state']} rollout: abort or finish the rollout first")
        stored = await self.store.get_policy(model)
        weight = stored.spec.weights.get(version, 0) if stored is not None and stored.spec is not None else 0
        if weight:
            raise Conflict(f"version {version} of model '{model}' takes {weight}% of its traffic in policy revision "
                           f"{stored.revision if stored else 0}: move its weight to another version first")
        await self._refuse_if_named_elsewhere(model, version)

    async def _refuse_if_named_elsewhere(self, model: str, version: str) -> None:
        """409 naming another model that still needs the version: a policy whose weight goes to it
        (``qc`` -> ``qc_2026_12@2``), or an ensemble's active canary running it inside its variant."""
        for other, stored in (await self.store.list_policies()).items():
            if other == model or stored.spec is None:
                continue
            for key, weight in stored.spec.weights.items():
                target = parse_target(key)
                if weight and target.model == model and target.version == version and target.fleet is None:
                    raise Conflict(f"version {version} of model '{model}' takes {weight}% of the traffic of "
                                   f"'{other}' (target {key}): move that weight first")
        for other, record in (await self.store.list_rollouts()).items():
            variant = record.document.get("variant") or {}
            if variant.get("model") == model and variant.get("canary_version") == version \
                    and record.document["state"] in ("progressing", "paused", "rolling_back"):
                raise Conflict(f"version {version} of model '{model}' runs inside '{variant['name']}', the variant "
                               f"of the {record.document['state']} canary of ensemble '{other}': abort or finish "
                               "that rollout first")

    async def _record(self, model: str, loaded: list[str] | None = None, unloaded: list[str] | None = None) -> None:
        """Note a load or unload the gateway made (only those are ever restored)."""
        changes = (await self.store.loaded_versions()).get(model, [])
        await self.store.put_loaded_versions(model, with_change(changes, loaded or (), unloaded or ()))

    async def restore(self) -> list[str]:
        """Bring back what the gateway loaded and unloaded, per model (after a restart Triton
        falls back to config.pbtxt's list); loads and unloads made on Triton's own port stay as
        they are (:func:`~gateway.services.triton_control.restore_target`). A mismatch must outlast ``RESTORE_GRACE_S``
        (a load on another replica reloads Triton a moment before it records the new set), and
        models where anything is loading are left for the next call. Returns the models reloaded."""
        restored = []
        for model in await self.store.loaded_versions():
            try:
                # the wanted set is read under the model's lifecycle lease: never older than any replica's load
                async with self.replicas.lock(model, RESTORE_LOCK_WAIT_S):
                    done = await self._restore_one(model)
            except Conflict:
                continue  # a load or unload of this model is running somewhere: look again next time
            if done is not None:
                restored.append(model)
                await self._event(model, "gateway", "versions_restored", f"Triton served {sorted(done[0], key=int)} "
                                  f"(restarted?); versions {sorted(done[1], key=int)} loaded again ({done[2]})")
        return restored

    async def _restore_one(self, model: str) -> tuple[set[str], set[str], str] | None:
        changes = (await self.store.loaded_versions()).get(model, [])
        states = await self.triton.versions(model)
        if not changes or not states or any(s.state in ("LOADING", "UNLOADING") for s in states.values()):
            return None
        ready = {v for v, s in states.items() if s.state == "READY"}
        wanted = restore_target(ready, changes) or ready
        if not self._mismatch_lasted(model, ready, wanted):
            return None
        return ready, wanted, await self._reload(model, wanted, self.load_timeout_s)

    def _mismatch_lasted(self, model: str, ready: set[str], wanted: set[str]) -> bool:
        if ready == wanted:
            self._mismatch_since.pop(model, None)
            return False
        seen = self._mismatch_since.setdefault(model, (frozenset(ready), time.monotonic()))
        if seen[0] != ready:
            self._mismatch_since[model] = (frozenset(ready), time.monotonic())
            return False
        if time.monotonic() - seen[1] < RESTORE_GRACE_S:
            return False
        del self._mismatch_since[model]
        return True

    async def _take_out_of_policy(self, model: str, version: str, actor: str) -> None:
        stored = await self.store.get_policy(model)
        if stored is None or stored.spec is None or version not in stored.spec.versions() and \
                version not in stored.spec.weights:
            return
        try:
            spec = without_version(stored.spec, version)
        except ValueError:
            raise Conflict(f"cannot take version {version} out of the policy of '{model}': nothing left to route to") \
                from None
        await self.policies.put(model, spec, stored.revision, EventDraft(actor, "drain", f"draining version {version}"),
                                require_ready=False)

    async def _reload(self, model: str, versions: set[str], timeout_s: float) -> str:
        return await self.triton.reload(model, versions, timeout_s)  # every server of the fleet, or none anew

    async def _event(self, model: str, actor: str, action: str, reason: str) -> None:
        log.info(json.dumps({"type": "lifecycle", "model": model, "actor": actor, "action": action,
                             "reason": reason}))
        await self.policies.audit(model, actor, action, reason)
