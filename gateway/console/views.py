"""What each console page shows, read through the services the admin API uses (never a copy of
their logic): the pages' JSON documents."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from gateway.console.timeline import Timeline
from gateway.errors import GatewayError, MetricsUnavailable, NotFound
from gateway.fleet.registry import Fleets
from gateway.rollout.controller import RolloutController
from gateway.rollout.evidence_words import with_words, with_words_all
from gateway.rollout.history import finished_rollouts
from gateway.rollout.steps import was_rolled_back
from gateway.services.policies import PolicyService
from gateway.services.state_sync import StateSync
from gateway.services.version_diff import VersionDifferences, stable_of
from gateway.store.base import Event
from gateway.store.changes import changes
from gateway.telemetry.recorder import Recorder
from gateway.telemetry.sources import MetricsSource

LIVE_S = 30.0  # the overview's rates without a rollout: the last 30 s (a rollout's default interval)
HISTORY_SHOWN = 20  # finished rollouts on a model's page
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
    differences: VersionDifferences

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
        now = time.time()
        for model in models:
            model["servers"] = _servers_with(model["name"], fleets)
            model["live_window"] = live_window(model.get("policy"), rollouts.get(model["name"]), now)
            model["live"] = await self._live(model, model["live_window"]["seconds"])
            model["rollout"] = _rollout_summary(rollouts.get(model["name"]))
        attention += self._attention(rollouts, fleets, store_up)
        return {"models": models, "attention": attention, "store_up": store_up,
                "rates_from": self.rates_from(), "window_s": LIVE_S}

    async def model(self, model: str) -> dict[str, Any]:
        """The model's page; NotFound (with what is known) when nothing knows the model: not Triton,
        not the store (a typo'd model gets no page with every action on it)."""
        try:
            policy: dict[str, Any] | None = (await self.policies.get(model)).document()
        except NotFound:
            policy = None
        triton_answered = True
        try:
            versions = [{"version": v.version, "state": v.state, "reason": v.reason}
                        for v in (await self.policies.triton.versions(model)).values()]
        except GatewayError:
            versions, triton_answered = [], False
        try:
            rollout: dict[str, Any] | None = await self.rollouts.status(model)
        except NotFound:
            rollout = None
        history = await finished_rollouts(self.rollouts.store, model, HISTORY_SHOWN)
        if triton_answered and not versions and policy is None and rollout is None and not history \
                and not self.differences.has_folder(model):
            raise ModelNotFound(model, await self._known_models())
        if rollout is not None:
            rollout["needs_acknowledgement"] = unacknowledged_rollback(rollout)
        timeline = self.timeline.history(model)
        if timeline is not None and rollout is not None:  # the console's own copies of the verdicts, in words too
            versus = "baseline" if rollout.get("baseline") else "stable"
            timeline["intervals"] = [{**i, "verdict": with_words(i["verdict"], versus)} for i in timeline["intervals"]]
        return {"model": model, "policy": policy, "versions": sorted(versions, key=lambda v: _order(v["version"])),
                "rollout": rollout, "why": why(rollout), "timeline": timeline,
                "history": [with_words_all(doc) for doc in history],
                "servers": _servers_with(model, self.fleets.describe()), "rates_from": self.rates_from()}

    async def version(self, model: str, version: str, against: str | None) -> dict[str, Any]:
        """One version's page: its state (an unloaded one points to loading it) and what differs
        from the stable version. NotFound when neither Triton nor the model repository has it."""
        unreadable: str | None = None
        try:
            states = await self.policies.triton.versions(model)
        except GatewayError as exc:
            states, unreadable = {}, exc.message
        state = states.get(version)
        in_repository = self.differences.has_folder(model, version)
        if state is None and unreadable is None and not in_repository:
            known = sorted(states, key=lambda v: _order(v))
            raise ModelNotFound(model, known, f"version {version} of model '{model}' not found: Triton lists no such "
                                "version" + (" and the model repository has no such folder"
                                             if self.differences.repository is not None else ""))
        doc: dict[str, Any] = {"model": model, "version": version, "rates_from": self.rates_from(),
                               "state": None if state is None else {"state": state.state, "reason": state.reason}}
        if state is None:
            doc["state"] = {"state": "UNKNOWN", "reason": unreadable or "Triton lists no such version, but the model "
                            "repository has its folder"}
        if doc["state"]["state"] != "READY":
            doc["load_hint"] = (f"Version {version} of {model} is not serving ({doc['state']['state']}"
                                + (f": {doc['state']['reason']}" if doc["state"]["reason"] else "") + "). Load it to "
                                f"serve it or roll it out: the button below, `gateway ctl versions load {model} "
                                f"{version}`, or POST /admin/models/{model}/versions/{version}/load.")
        try:
            policy: dict[str, Any] | None = (await self.policies.get(model)).document()
        except NotFound:
            policy = None
        stored = await self.rollouts.store.get_rollout(model)
        ready = [v for v, s in states.items() if s.state == "READY"]
        chosen, why_chosen = (against, "chosen") if against else stable_of(
            version, policy, stored.document if stored is not None else None, ready)
        doc.update(against=chosen, against_why=why_chosen)
        if chosen is not None and chosen != version:
            try:
                doc.update(await self.differences.compare(model, version, chosen))
            except ValueError as exc:  # a target key that does not read
                doc.update(config={"note": f"not compared: {exc}"}, files={"readable": False, "why": str(exc)})
        return doc

    async def _known_models(self) -> list[str]:
        try:
            return sorted({entry["name"] for entry in await self.policies.triton.index()})
        except GatewayError:
            return []

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

    async def _live(self, model: dict[str, Any], seconds: float) -> dict[str, Any]:
        versions = {v["version"] for v in model["versions"] if v.get("state") == "READY"}
        if model.get("policy"):
            versions |= {k for k in model["policy"]["weights"] if ":" not in k}
        live: dict[str, Any] = {}
        for version in sorted(versions, key=_order):
            try:
                window = await asyncio.wait_for(self.source.window(model["name"], version, seconds), 2.0)
            except (MetricsUnavailable, TimeoutError):
                continue
            live[version] = {"rps": round(window.requests / max(window.seconds, 1.0), 3), "requests": window.requests,
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


def live_window(policy: dict[str, Any] | None, rollout: dict[str, Any] | None, now: float) -> dict[str, Any]:
    """The span the overview's live figures cover: the current interval, the rollout's own while
    one runs (else the last LIVE_S), never reaching back before the weights last changed, so
    they describe the traffic the weights bar beside them shows (a 5-minute average showed a
    canary's errors from before its rollback, and a paused canary at six times its weight)."""
    length = LIVE_S
    since = float(policy["updated_at"]) if policy and policy.get("updated_at") else 0.0
    running = rollout is not None and rollout.get("state") in ("progressing", "paused", "rolling_back")
    if running and rollout is not None:
        length = float((rollout.get("spec") or {}).get("interval_s") or LIVE_S)
        since = max(since, float(rollout.get("step_started_at") or 0), float(rollout.get("last_transition_at") or 0))
    seconds = max(1.0, min(length, now - since)) if since else length
    if running:
        label = f"this interval: the last {seconds:.0f} s of the rollout's {length:g} s"
    else:
        label = f"the last {seconds:.0f} s"
    if since and now - since < length:
        label += " (since the weights changed)"
    return {"seconds": seconds, "label": label}


class ModelNotFound(NotFound):
    """A model (or version) nothing knows: the page says so, with the ones that exist."""

    def __init__(self, model: str, known: list[str], message: str | None = None) -> None:
        super().__init__(message or f"model '{model}' not found: Triton lists no such model, the model repository "
                         "has no such folder, and it has no policy and no rollout")
        self.known = known


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
    """One sentence: why the rollout was rolled back, paused or held, from the verdict's own summary;
    a rollback's then says it in words (the failed metric's ``words``): the summary's "evidence over
    1,000,000x, needed 600x" was the first thing on the page and the last a person reads easily."""
    if rollout is None:
        return None
    state, verdicts = rollout.get("state"), rollout.get("verdicts") or []
    if state in ("rolled_back", "rolling_back"):
        failed = [v for v in verdicts if v.get("outcome") == "unhealthy"]
        if failed:
            last = failed[-1]
            worse = [m for m in last.get("metrics") or [] if m.get("verdict") == "fail" and m.get("words")]
            named = [m for m in worse if m.get("name") == last.get("metric")]  # the one the sentence names
            words = " ".join(str(m["words"]) for m in named or worse)
            return f"Rolled back because {last.get('metric') or 'a check'} failed: {last.get('reason')}." + (
                f" In words: {words}" if words else "")
        return f"Rolled back: {rollout.get('reason')}."
    if state == "paused":
        return f"Paused: {rollout.get('reason')}."
    warmup = rollout.get("warmup") or {}
    if state == "progressing" and warmup.get("state") == "warming":
        return f"Warming up on mirrored traffic before its first step: {warmup.get('test')}."
    if state == "progressing" and str(rollout.get("reason", "")).startswith("held:"):
        return f"Held at step {int(rollout.get('step', 0)) + 1}: {str(rollout['reason']).removeprefix('held: ')}."
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
