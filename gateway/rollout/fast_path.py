"""The fast path: roll back at once, without waiting for an interval's verdict, but only for
failures that are the canary's own.

A connection error, a Triton restart or a full queue hits every version alike; rolling back
on it throws away a good canary (and at the 100% step the stable has no traffic to compare
with). So the fast path fires only when

- Triton reports the canary not READY while the stable is READY, or
- the data path saw "version unavailable" answers from the canary and none from the stable
  or the baseline (below 100%: at the 100% step the stable takes no traffic to compare with,
  so only readiness counts there).

A rollout's baseline that is not READY while the canary is pauses the rollout
(:meth:`FastPath.check`): it is nobody's failure, but nothing is left to judge with.

Both readiness answers come from one snapshot of Triton's repository index, so a Triton that
is restarting (nothing READY) never looks like a broken canary.

A paused rollout never gets here: its weights belong to the humans.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from gateway.errors import GatewayError
from gateway.rollout.steps import Rollout
from gateway.services.triton_control import VersionState
from gateway.telemetry.recorder import Recorder

# Failures the data path records per version that only a broken version produces.
VERSION_SPECIFIC_KINDS = ("VersionUnavailable",)


class VersionStates(Protocol):
    async def target_states(self, model: str, keys: set[str]) -> tuple[dict[str, VersionState], bool]: ...


class FastPath:
    def __init__(self, recorder: Recorder, triton: VersionStates, call_timeout_s: float) -> None:
        self.recorder = recorder
        self.triton = triton
        self.call_timeout_s = call_timeout_s
        self._seen: dict[tuple[str, str, str], int] = {}
        self._counting_from: dict[str, float] = {}  # model -> the rollout's fast_path_from counted from here
        self.troubled_at: dict[str, float] = {}  # model -> last time Triton itself could not serve it

    def baseline(self, model: str, *versions: str) -> None:
        """Only failures from now on count."""
        for version in versions:
            for kind in VERSION_SPECIFIC_KINDS:
                self._new_failures(model, version, kind)

    def count_from(self, rollout: Rollout) -> None:
        """Only failures from now on count, for the rollout's ``fast_path_from`` (its start, its
        last resume). :meth:`check` calls it when the record names a moment this replica has not
        counted from yet: the lease holder resets its own counts, whichever replica served the
        command (failures seen during a pause must not roll a resumed canary back)."""
        self._counting_from[rollout.model] = rollout.fast_path_from
        self.baseline(rollout.model, *dict.fromkeys((rollout.canary, rollout.stable, rollout.reference)))

    async def states(self, model: str, *keys: str) -> tuple[dict[str, VersionState], bool] | None:
        """One snapshot of the repository index of the fleets the target keys (``version`` or
        ``fleet:version``) name, within the call timeout: the keys' states, and whether anything
        of the model is loading; None when Triton cannot be asked."""
        try:
            async with asyncio.timeout(self.call_timeout_s):
                return await self.triton.target_states(model, set(keys))
        except (TimeoutError, GatewayError):
            return None

    async def ready(self, model: str, version: str) -> bool | None:
        snapshot = await self.states(model, version)
        if snapshot is None:
            return None
        state = snapshot[0].get(version)
        return state is not None and state.state == "READY"

    async def check(self, rollout: Rollout) -> tuple[str | None, str | None]:
        """From one snapshot of Triton's index: why the canary must be rolled back at once, and
        why the rollout must pause (its baseline cannot serve); (None, None) when neither."""
        if self._counting_from.get(rollout.model) != rollout.fast_path_from:
            self.count_from(rollout)
        if rollout.canary_percent == 0:
            return None, None
        failures = {kind: self._new_failures(rollout.model, rollout.canary, kind) for kind in VERSION_SPECIFIC_KINDS}
        # the stable's, and a baseline's (from the 50% step on, the stable may take no traffic at all)
        stable_failures = {kind: sum(self._new_failures(rollout.model, version, kind)
                                     for version in dict.fromkeys((rollout.stable, rollout.reference)))
                           for kind in VERSION_SPECIFIC_KINDS}
        snapshot = await self.states(rollout.model, *dict.fromkeys((rollout.canary, rollout.stable, rollout.reference)))
        states, busy = snapshot if snapshot is not None else ({}, False)
        stable = states.get(rollout.stable)
        canary = states.get(rollout.canary)
        stable_ready = stable is not None and stable.state == "READY"
        if snapshot is None or busy or (not stable_ready and (canary is None or canary.state != "READY")):
            # Triton-wide trouble (down, restarting, reloading the model): nothing is the canary's
            # own, and the judge is told not to hold this interval's errors against it.
            self.troubled_at[rollout.model] = time.monotonic()
            return None, None
        if canary is None or canary.state not in ("READY", "LOADING"):
            if not stable_ready:
                return None, None  # nothing to roll back to at once; the judge may still roll back (and wait)
            return (f"Triton reports version {rollout.canary} {_shown(canary)}, not READY, while {rollout.stable} "
                    "is READY"), None
        missing = _baseline_missing(rollout, states) if canary.state == "READY" else None
        if not stable_ready or rollout.canary_percent == 100:
            return None, missing  # no stable to roll back to at once / no stable traffic to compare with
        for kind, count in failures.items():
            if count and not stable_failures[kind]:
                return f"version {rollout.canary} failed with {kind} ({count} requests) while stable did not", None
        return None, missing

    def _new_failures(self, model: str, version: str, kind: str) -> int:
        """Failures of this kind since the previous look (0 on the first look)."""
        key = (model, version, kind)
        count = self.recorder.upstream_errors.get(key, 0)
        previous = self._seen.get(key)
        self._seen[key] = count
        return 0 if previous is None else count - previous

    def troubled_within(self, model: str, seconds: float) -> bool:
        """Triton could not serve the model (both versions) at some tick of the last ``seconds``."""
        at = self.troubled_at.get(model)
        return at is not None and time.monotonic() - at <= seconds


def _shown(state: VersionState | None) -> str:
    """A version's state in Triton's index, in words."""
    if state is None:
        return "not in the repository index"
    return f"{state.state} ({state.reason})" if state.reason else state.state


def _baseline_missing(rollout: Rollout, states: dict[str, VersionState]) -> str | None:
    """Why the rollout's baseline cannot serve (not READY while the canary is), if it has one:
    then nothing is left to judge the canary against, and the baseline's requests go to another
    version (from the 50% step on, the canary)."""
    baseline = rollout.spec.baseline
    if baseline is None or rollout.canary_percent == 100:
        return None
    state = states.get(baseline)
    if state is not None and state.state in ("READY", "LOADING"):
        return None
    return (f"baseline version {baseline} is {_shown(state)} on Triton: the canary cannot be judged without it; "
            "load it again and resume, or abort")
