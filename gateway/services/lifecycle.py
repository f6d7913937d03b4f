"""Zero-downtime version lifecycle: load a version beside the serving ones; drain, then unload.

Triton loads and unloads whole models; a version-level change is a reload with a
``version_policy`` override naming the versions to keep. Triton's reload is atomic: a
version that fails to initialise leaves the old ones serving. Unloading first *drains*:
the version leaves every policy, then we wait until this gateway has no request in
flight to it and no open sequence pinned to it (or the drain timeout), and only then ask
Triton to drop it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from gateway.errors import Conflict, LoadFailed, NotFound
from gateway.policy import without_version
from gateway.sequences import SequencePins
from gateway.services.policies import PolicyService
from gateway.services.triton_control import TritonControl
from gateway.store.base import EventDraft, StateStore
from gateway.telemetry.recorder import Recorder

log = logging.getLogger("gateway.lifecycle")


class ModelLifecycle:
    def __init__(self, store: StateStore, triton: TritonControl, policies: PolicyService, recorder: Recorder,
                 pins: SequencePins, load_timeout_s: float = 300.0, drain_timeout_s: float = 60.0) -> None:
        self.store = store
        self.triton = triton
        self.policies = policies
        self.recorder = recorder
        self.pins = pins
        self.load_timeout_s = load_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self._lock = asyncio.Lock()  # one reload of a model at a time (control plane only)

    async def serving(self, model: str) -> set[str]:
        return {v for v, state in (await self.triton.versions(model)).items() if state.state == "READY"}

    async def load(self, model: str, version: str, actor: str) -> dict[str, Any]:
        async with self._lock:
            serving = await self.serving(model)
            if version in serving:
                return {"model": model, "version": version, "state": "READY", "serving": sorted(serving, key=int)}
            keep = serving | {version}
            await self._reload(model, keep, self.load_timeout_s)
            states = await self.triton.versions(model)
            state = states.get(version)
            if state is None or state.state != "READY":
                why = state.reason if state else "not in the repository index"
                raise LoadFailed(f"version {version} of model '{model}' did not become READY: {why}")
        await self._event(model, actor, "version_loaded", f"version {version} loaded beside {sorted(serving)}")
        return {"model": model, "version": version, "state": "READY", "serving": sorted(keep, key=int)}

    async def unload(self, model: str, version: str, actor: str) -> dict[str, Any]:
        serving = await self.serving(model)
        if version not in serving:
            raise NotFound(f"version {version} of model '{model}' is not loaded")
        if serving == {version}:
            raise Conflict(f"version {version} is the only version of model '{model}' serving: load another first")
        await self._take_out_of_policy(model, version, actor)
        drained = await self._drain(model, version)
        async with self._lock:
            await self._reload(model, await self.serving(model) - {version}, self.load_timeout_s)
        reason = f"version {version} drained ({drained}) and unloaded"
        await self._event(model, actor, "version_unloaded", reason)
        return {"model": model, "version": version, "state": "UNLOADED", "drain": drained}

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

    async def _drain(self, model: str, version: str) -> str:
        started = time.monotonic()
        while time.monotonic() - started < self.drain_timeout_s:
            inflight = self.recorder.inflight.get((model, version), 0)
            sequences = self.pins.open_on(model, version)
            if inflight <= 0 and sequences == 0:
                return f"idle after {time.monotonic() - started:.1f}s"
            await asyncio.sleep(0.05)
        return f"timed out after {self.drain_timeout_s:g}s"

    async def _reload(self, model: str, versions: set[str], timeout_s: float) -> None:
        await self.triton.reload(model, versions, timeout_s)  # every server of the fleet, or none anew

    async def _event(self, model: str, actor: str, action: str, reason: str) -> None:
        log.info(json.dumps({"type": "lifecycle", "model": model, "actor": actor, "action": action,
                             "reason": reason}))
        await self.policies.audit(model, actor, action, reason)
