"""The fast path: roll back at once, without waiting for an interval's verdict, but only for
failures that are the canary's own.

A connection error, a Triton restart or a full queue hits every version alike; rolling back
on it throws away a good canary (and at the 100% step the stable has no traffic to compare
with). So the fast path fires only when

- Triton reports the canary not READY while the stable is READY, or
- the data path saw "version unavailable" answers from the canary and none from the stable;
  at the 100% step, where the stable takes no traffic, the stable's readiness stands in for
  its traffic.

A paused rollout never gets here: its weights belong to the humans.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from gateway.errors import GatewayError
from gateway.rollout.steps import Rollout
from gateway.telemetry.recorder import Recorder

# Failures the data path records per version that only a broken version produces.
VERSION_SPECIFIC_KINDS = ("VersionUnavailable",)


class Readiness(Protocol):
    async def is_version_ready(self, model: str, version: str) -> bool | None: ...


class FastPath:
    def __init__(self, recorder: Recorder, triton: Readiness, call_timeout_s: float) -> None:
        self.recorder = recorder
        self.triton = triton
        self.call_timeout_s = call_timeout_s
        self._seen: dict[tuple[str, str, str], int] = {}

    def baseline(self, model: str, *versions: str) -> None:
        """Only failures from now on count (a new rollout, or after a pause)."""
        for version in versions:
            for kind in VERSION_SPECIFIC_KINDS:
                self._new_failures(model, version, kind)

    async def ready(self, model: str, version: str) -> bool | None:
        """Triton's word, within the call timeout; None when it cannot be asked."""
        try:
            async with asyncio.timeout(self.call_timeout_s):
                return await self.triton.is_version_ready(model, version)
        except (TimeoutError, GatewayError):
            return None

    async def reason_to_roll_back(self, rollout: Rollout) -> str | None:
        if rollout.canary_percent == 0:
            return None
        canary_ready = await self.ready(rollout.model, rollout.canary)
        failures = {kind: self._new_failures(rollout.model, rollout.canary, kind) for kind in VERSION_SPECIFIC_KINDS}
        stable_failures = {kind: self._new_failures(rollout.model, rollout.stable, kind)
                           for kind in VERSION_SPECIFIC_KINDS}
        if canary_ready is not False and not any(failures.values()):
            return None
        stable_ready = await self.ready(rollout.model, rollout.stable)
        if stable_ready is not True:
            return None  # Triton-wide trouble (a restart), or nothing to roll back to: hold
        if canary_ready is False:
            return f"Triton reports version {rollout.canary} not READY"
        for kind, count in failures.items():
            if count and (rollout.canary_percent == 100 or not stable_failures[kind]):
                return f"version {rollout.canary} failed with {kind} ({count} requests) while stable did not"
        return None

    def _new_failures(self, model: str, version: str, kind: str) -> int:
        """Failures of this kind since the previous look (0 on the first look)."""
        key = (model, version, kind)
        count = self.recorder.upstream_errors.get(key, 0)
        previous = self._seen.get(key)
        self._seen[key] = count
        return 0 if previous is None else count - previous
