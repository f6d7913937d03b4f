"""What each console page shows, read through the services the admin API uses (never a copy of
their logic): the pages' JSON documents."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from gateway.console.timeline import Timeline
from gateway.errors import GatewayError, MetricsUnavailable, NotFound
from gateway.fleet.registry import Fleets
from gateway.rollout.controller import RolloutController
from gateway.rollout.steps import was_rolled_back
from gateway.services.policies import PolicyService
from gateway.services.state_sync import StateSync
from gateway.store.base import Event
from gateway.store.changes import changes
from gateway.telemetry.recorder import Recorder
from gateway.telemetry.sources import MetricsSource

LIVE_S = 300.0  # the overview's rates: the last 5 minutes
AUDIT_PAGE = 50
AUDIT_SCAN = 5000  # a filtered audit view searches this many of the newest events
ATTENTION_STATES = ("paused", "rolling_back")
VIA = " (via: console)"  # how the audit trail tells a console action from an API call


def console_actor(name: str) -> str:
    return name + VIA


def split_actor(actor: str) -> tuple[str, str]:
    """An audit line's actor as (name, via): 'alice (via: console)' -> ('alice', 'console')."""
    if actor.endswith(VIA):
        return actor[: -len(VIA)], "console"
    return actor, "api"


@dataclass
class Views:
    policies: PolicyService
    rollouts: RolloutController
    fleets: Fleets
    sync: StateSync
    source: MetricsSource
    recorder: Recorder
    timeline: Timeline
    metrics_source: str

    async def overview(self) -> dict[str, Any]:
        attention: list[dict[str, Any]] = []
        store_up = self.recorder.store_up
        try:
            models = await self.policies.models()
        except GatewayError as exc:
            models = [{"name": m, "versions": [], "policy": None} for m in sorted(self.policies.book.snapshot())]
            attention.append({"level": "error", "text": f"model index unavailable: {exc.message}"})
        try:
            rollouts = {m: r.document for m, r in (await self.rollouts.store.list_rollouts()).items()}
        except GatewayError:
            rollouts, store_up = {}, False  # said once, by _attention
        fleets = self.fleets.describe()
        for model in models:
            model["servers"] = _servers_with(model["name"], fleets)
            model["live"] = await self._live(model)
            model["rollout"] = _rollout_summary(rollouts.get(model["name"]))
        attention += self._attention(rollouts, fleets, store_up)
        return {"models": models, "attention": attention, "store_up": store_up,
                "rates_from": self.rates_from(), "window_s": LIVE_S}

    async def model(self, model: str) -> dict[str, Any]:
        try:
            policy: dict[str, Any] | None = (await self.policies.get(model)).document()
        except NotFound:
            policy = None
        try:
            versions = [{"version": v.version, "state": v.state, "reason": v.reason}
                        for v in (await self.policies.triton.versions(model)).values()]
        except GatewayError:
            versions = []
        try:
            rollout: dict[str, Any] | None = await self.rollouts.status(model)
        except NotFound:
            rollout = None
        return {"model": model, "policy": policy, "versions": sorted(versions, key=lambda v: _order(v["version"])),
                "rollout": rollout, "why": why(rollout), "timeline": self.timeline.history(model),
                "servers": _servers_with(model, self.fleets.describe()), "rates_from": self.rates_from()}

    def fleet_page(self) -> dict[str, Any]:
        return {"fleets": self.fleets.describe()}

    async def audit(self, model: str | None, actor: str | None, action: str | None, page: int) -> dict[str, Any]:
        filtered = bool(actor or action)
        wanted = AUDIT_SCAN if filtered else (page + 1) * AUDIT_PAGE + 1
        events = await self.policies.events(model or None, wanted)
        rows = [e for e in events if _matches(e, actor, action)]
        shown = rows[page * AUDIT_PAGE:(page + 1) * AUDIT_PAGE]
        return {"events": [_event(e) for e in shown], "page": page, "page_size": AUDIT_PAGE,
                "more": len(rows) > (page + 1) * AUDIT_PAGE,
                "searched": len(events), "scan_limit": AUDIT_SCAN if filtered else None}

    def rates_from(self) -> str:
        return "prometheus (every replica)" if self.metrics_source == "prometheus" else "this replica"

    async def _live(self, model: dict[str, Any]) -> dict[str, Any]:
        versions = {v["version"] for v in model["versions"] if v.get("state") == "READY"}
        if model.get("policy"):
            versions |= {k for k in model["policy"]["weights"] if ":" not in k}
        live: dict[str, Any] = {}
        for version in sorted(versions, key=_order):
            try:
                window = await asyncio.wait_for(self.source.window(model["name"], version, LIVE_S), 2.0)
            except (MetricsUnavailable, TimeoutError):
                continue
            live[version] = {"rps": round(window.requests / LIVE_S, 3), "requests": window.requests,
                             "errors": window.errors, "error_rate": window.error_rate,
                             "client_errors": window.client_errors}
        return live

    def _attention(self, rollouts: dict[str, dict[str, Any]], fleets: dict[str, list[dict[str, Any]]],
                   store_up: bool) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        if not store_up:
            found.append({"level": "error", "text": "the state store is down: this replica serves its last policies"})
        problem = self.sync.problem()
        if problem:
            found.append({"level": "error", "text": problem})
        for model, doc in sorted(rollouts.items()):
            if doc.get("state") in ATTENTION_STATES:
                found.append({"level": "warning", "model": model,
                              "text": f"rollout of {model} is {doc['state']}: {doc.get('reason', '')}"})
            elif unacknowledged_rollback(doc):
                found.append({"level": "error", "model": model, "acknowledge": True,
                              "text": f"rollout of {model} was rolled back: {doc.get('reason', '')} (stays here "
                              "until acknowledged)"})
        for model, blocked in sorted(self.recorder.rollback_blocked.items()):
            if blocked:
                found.append({"level": "error", "model": model, "text": f"the rollback of {model} is blocked: its "
                              "stable version is not READY (gateway_rollback_blocked)"})
        for fleet, servers in sorted(fleets.items()):
            for server in servers:
                if server.get("ejected") or not server.get("up", True):
                    state = "ejected" if server.get("ejected") else "down"
                    found.append({"level": "warning", "text": f"server {server['server']} of fleet {fleet} is {state}"
                                  + (f": {server['last_error']}" if server.get("last_error") else "")})
        return found


def unacknowledged_rollback(doc: dict[str, Any]) -> bool:
    """A finished rollback nobody has said they saw (it stays in "Needs attention")."""
    try:
        return was_rolled_back(doc) and not doc.get("acknowledged")
    except (KeyError, TypeError):
        return False  # a record this version cannot read: the rollout page says so


def _order(version: str) -> tuple[int, str]:
    tail = version.rpartition(":")[2]
    return (int(tail), version) if tail.isdigit() else (1 << 62, version)


def _servers_with(model: str, fleets: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each fleet server and the versions of ``model`` READY on it."""
    return [{"fleet": fleet, "server": s["server"], "up": s.get("up"), "ejected": s.get("ejected"),
             "ready": (s.get("ready") or {}).get(model, [])} for fleet, servers in fleets.items() for s in servers]


def _rollout_summary(doc: dict[str, Any] | None) -> dict[str, Any] | None:
    if doc is None:
        return None
    return {"state": doc.get("state"), "step": doc.get("step"), "steps": doc.get("steps"),
            "canary": doc.get("canary"), "stable": doc.get("stable"), "weights": doc.get("weights"),
            "reason": doc.get("reason")}


def why(rollout: dict[str, Any] | None) -> str | None:
    """One sentence: why the rollout was rolled back, paused or held, from the verdict's own summary."""
    if rollout is None:
        return None
    state, verdicts = rollout.get("state"), rollout.get("verdicts") or []
    if state in ("rolled_back", "rolling_back"):
        failed = [v for v in verdicts if v.get("outcome") == "unhealthy"]
        if failed:
            last = failed[-1]
            return f"Rolled back because {last.get('metric') or 'a check'} failed: {last.get('reason')}."
        return f"Rolled back: {rollout.get('reason')}."
    if state == "paused":
        return f"Paused: {rollout.get('reason')}."
    if state == "progressing" and verdicts and verdicts[-1].get("outcome") in ("inconclusive", "error"):
        return f"Held at step {int(rollout.get('step', 0)) + 1}: {verdicts[-1].get('reason')}."
    if state == "progressing" and rollout.get("awaiting_promote"):
        return "Held: healthy, waiting for an operator's promote."
    return None


def _matches(event: Event, actor: str | None, action: str | None) -> bool:
    if action and event.action != action:
        return False
    return not actor or split_actor(event.actor)[0] == actor


def _event(event: Event) -> dict[str, Any]:
    name, via = split_actor(event.actor)
    return {"id": event.id, "at": event.at, "actor": name, "via": via, "action": event.action,
            "model": event.model, "reason": event.reason, "changes": changes(event.before, event.after)}
