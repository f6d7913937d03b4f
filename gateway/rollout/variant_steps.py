"""The steps of a rollout inside an ensemble that the reconcile tick takes besides the weights
(:mod:`gateway.services.ensembles` says what a variant is): each verdict attributed by the
composing model's versions in Triton, the ensemble pinned and the variant unloaded once the
rollout is over, and both put back after a Triton restart."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from gateway.errors import GatewayError
from gateway.rollout.phases import Phase
from gateway.rollout.steps import Rollout
from gateway.services.engine_stats import EngineReading
from gateway.services.ensembles import FOLDED, LOADED, UNLOADED, gateway_pins
from gateway.store.base import StoredRollout

if TYPE_CHECKING:
    from gateway.rollout.controller import RolloutController

log = logging.getLogger("gateway.rollout")
ACTOR = "rollout-controller"


class VariantSteps:
    def __init__(self, controller: RolloutController) -> None:
        self.controller = controller

    async def attributed(self, rollout: Rollout) -> Rollout:
        """The interval's verdict of a canary inside an ensemble, with the composing model's two
        versions in Triton over the same interval (Triton labels every ensemble version 1: only
        the composing versions tell the arms apart inside it)."""
        try:
            async with asyncio.timeout(self.controller.call_timeout_s):
                found, reading = await self.controller.ensembles.attribution(rollout.variant)
        except (GatewayError, TimeoutError):
            return rollout  # unreadable: the verdict stands on the gateway's view alone
        verdicts = rollout.verdicts
        if found is not None:
            verdicts = (*verdicts[:-1], {**verdicts[-1], "composing": found["summary"]})
        return dataclasses.replace(rollout, verdicts=verdicts,
                                   variant={**rollout.variant, "reading": reading.document()})

    async def settle(self, rollout: Rollout) -> Rollout:
        """A finished canary inside an ensemble, once its weights are in place: promoted, the
        ensemble itself pins the canary's version, then the traffic goes back to it (the
        weights of a folded rollout); then, or at once when rolled back or aborted, the variant
        is drained and unloaded. Each step is recorded before the next, so a restart resumes it."""
        variant, model = rollout.variant, rollout.model
        if rollout.phase is Phase.PROMOTED and variant["state"] == LOADED:
            since = EngineReading.from_document(variant.get("started_reading"))
            try:
                found, _ = await self.controller.ensembles.attribution(variant, since)
            except GatewayError:
                found = None
            done = await self.controller.ensembles.fold(variant, {variant["model"]: variant["canary_version"]})
            await self.controller.policies.audit(model, ACTOR, "ensemble_pinned", done, at=self.controller.clock())
            return dataclasses.replace(rollout, applied=False, apply_reason=done,
                                       variant={**variant, "state": FOLDED, "attribution": found})
        lifecycle = self.controller.lifecycle
        drained = "not drained (no lifecycle)" if lifecycle is None else \
            await lifecycle.replicas.drain(model, variant["name"], self.controller.lease_ttl_s / 4)
        await self.controller.ensembles.unload(variant)
        why = f"variant '{variant['name']}' drained ({drained}) and unloaded"
        await self.controller.policies.audit(model, ACTOR, "variant_unloaded", why, at=self.controller.clock())
        return dataclasses.replace(rollout, variant={**variant, "state": UNLOADED})

    async def restore(self, listed: Mapping[str, StoredRollout]) -> None:
        """After a Triton restart, what each ensemble's latest rollout record says: its variant
        loaded while the rollout is active, and the ensemble's pin of the composing model as the
        rollout left it (the canary's once promoted and pinned, else the stable's)."""
        for model, stored in list(listed.items()):
            variant = stored.document.get("variant") or {}
            if not variant:
                continue
            active = Phase(stored.document["state"]).active
            pins = gateway_pins(stored.document)
            if not pins and not active:
                continue  # nothing of it a restarted Triton could have lost
            try:
                done = await self.controller.ensembles.restore(variant, active, pins)
            except GatewayError as exc:
                log.warning("restoring the ensemble %s failed: %s", model, exc)
                continue
            if done is not None:
                await self.controller.policies.audit(model, "gateway", "ensemble_restored", f"Triton restarted? {done}",
                                          at=self.controller.clock())
