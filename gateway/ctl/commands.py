"""``gateway ctl``: the SRE's command line for the admin API.

Human tables by default (rich), ``--json`` for scripts. Exit codes: 0 done, 1 the API said
no (its message is printed), 2 bad usage or the gateway unreachable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from gateway.policy import target_order

Handler = Callable[[argparse.Namespace, "Api"], Any]


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Api:
    def __init__(self, url: str, token: str | None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=30)

    def call(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Any:
        response = self.client.request(method, path, json=body, headers=headers or {})
        try:
            payload = response.json()
        except ValueError:
            payload = {"error": response.text}
        if response.status_code >= 400:
            raise ApiError(response.status_code, payload.get("error", str(payload)) if isinstance(payload, dict)
                           else str(payload))
        return payload


def add_ctl_parser(commands: Any) -> None:
    ctl = commands.add_parser("ctl", help="talk to a running gateway's admin API",
                              description="SRE commands for a running gateway (admin API).")
    ctl.add_argument("--url", default=os.environ.get("GATEWAY_CTL_URL", "http://127.0.0.1:8080"),
                     help="gateway base URL (env GATEWAY_CTL_URL; default http://127.0.0.1:8080)")
    ctl.add_argument("--token", default=os.environ.get("GATEWAY_ADMIN_TOKEN"),
                     help="admin bearer token (env GATEWAY_ADMIN_TOKEN)")
    ctl.add_argument("--json", action="store_true", help="print raw JSON instead of tables")
    sub = ctl.add_subparsers(title="ctl commands", metavar="WHAT", required=True)

    sub.add_parser("models", help="models, version states and policies").set_defaults(ctl=_models)
    sub.add_parser("fleets", help="Triton servers per fleet: health, in flight, loaded versions").set_defaults(
        ctl=_fleets)

    policy = sub.add_parser("policy", help="get or set a model's whole policy").add_subparsers(
        metavar="ACTION", required=True)
    get = policy.add_parser("get", help="show the policy")
    get.add_argument("model")
    get.set_defaults(ctl=_policy_get)
    put = policy.add_parser("set", help="replace the policy from a JSON/YAML file, or change the parts the flags "
                            "name (--weights alone changes only the weights)")
    put.add_argument("model")
    put.add_argument("--file", help="policy document (JSON or YAML), as in the config's policies: section")
    put.add_argument("--weights", nargs="+", metavar="V=PCT", help="e.g. 2=80 3=20")
    put.add_argument("--sticky-header", help="header carrying the user id")
    put.add_argument("--rule", action="append", default=[], metavar="HEADER=VALUE:VERSION",
                     help="e.g. x-canary=always:3 (repeatable)")
    put.add_argument("--if-match", help="expected revision")
    put.set_defaults(ctl=_policy_set)
    delete = policy.add_parser("delete", help="remove the policy (back to Triton's default version)")
    delete.add_argument("model")
    delete.set_defaults(ctl=_policy_delete)

    weights = sub.add_parser("weights", help="change only the weights").add_subparsers(metavar="ACTION", required=True)
    wset = weights.add_parser("set", help="e.g. gateway ctl weights set qc 2=80 3=20")
    wset.add_argument("model")
    wset.add_argument("weights", nargs="+", metavar="V=PCT")
    wset.add_argument("--reason", help="why, for the audit trail")
    wset.add_argument("--if-match", help="expected revision (412 if someone changed it since)")
    wset.set_defaults(ctl=_weights_set)

    add_rollout_parser(sub)

    events = sub.add_parser("events", help="the audit trail, newest first")
    events.add_argument("--model")
    events.add_argument("--limit", type=int, default=20)
    events.set_defaults(ctl=_events)
    ctl.set_defaults(handler=run_ctl)


def add_rollout_parser(sub: Any) -> None:
    rollout = sub.add_parser("rollout", help="progressive rollouts: start, status [--watch], promote, pause, "
                             "resume, abort").add_subparsers(metavar="ACTION", required=True)
    start = rollout.add_parser("start", help="start moving traffic to a canary step by step")
    start.add_argument("model")
    start.add_argument("--canary", required=True, help="the new version")
    start.add_argument("--stable", help="default: the version now taking most traffic")
    start.add_argument("--baseline", help="a copy of the stable loaded as an older version than the canary: it "
                       "takes the canary's weight and the canary is judged against it (small hosts, sub-ms models)")
    start.add_argument("--steps", help="canary percent per step, e.g. 5,20,50,100 (the default)")
    start.add_argument("--interval", type=float, dest="interval_s", help="seconds per analysis interval (30)")
    start.add_argument("--judge", choices=["statistical", "thresholds"], help="statistical (the default): "
                       "canary vs stable with sequential tests; thresholds: absolute limits per interval")
    start.add_argument("--max-error-rate-increase", type=float, help="statistical: tolerated 5xx rate rise (0.01)")
    start.add_argument("--max-client-error-rate-increase", type=float,
                       help="statistical: tolerated 4xx rate rise (0.01)")
    start.add_argument("--max-latency-increase", type=float, help="statistical: tolerated latency ratio rise (0.2)")
    start.add_argument("--inconclusive-limit", type=int, help="statistical: undecided intervals before a pause (30)")
    start.add_argument("--retry", action="store_true", help="roll out a canary that the last rollout rolled back")
    start.add_argument("--max-error-rate", type=float, help="thresholds: e.g. 0.01 (the default)")
    start.add_argument("--max-p99-ms", type=float, help="thresholds: absolute p99 limit (none by default)")
    start.add_argument("--max-p99-ratio", type=float, help="thresholds: canary p99 / stable p99 limit (1.5)")
    start.add_argument("--min-requests", type=int, help="thresholds: fewer canary requests per interval: no "
                       "verdict (50)")
    start.add_argument("--failure-limit", type=int, help="unhealthy intervals in a row before rollback (2)")
    start.add_argument("--manual-gates", action="store_true", help="wait for `promote` after every healthy step")
    start.add_argument("--rollback", choices=["immediate", "gradual"], help="how an unhealthy canary goes back: "
                       "at once (the default) or down the rollback steps, one per interval")
    start.add_argument("--rollback-steps", help="canary percents on the way down, e.g. 50,20,0 (the "
                       "default; implies --rollback gradual)")
    start.add_argument("--critical-error-rate", type=float, help="an interval's canary error rate past this rolls "
                       "back at once, whatever the mode (0.5)")
    start.set_defaults(ctl=_rollout_start)
    status = rollout.add_parser("status", help="state, weights, verdicts; --watch for a live view")
    status.add_argument("model")
    status.add_argument("--watch", action="store_true", help="refresh every second until the rollout ends")
    status.set_defaults(ctl=_rollout_status)
    for action, text in (("promote", "go to the next step now"), ("pause", "hold the current step"),
                         ("resume", "continue a paused rollout"), ("abort", "send everything back to stable")):
        command = rollout.add_parser(action, help=text)
        command.add_argument("model")
        command.set_defaults(ctl=_rollout_command, action=action)


def run_ctl(args: argparse.Namespace) -> int:
    api = Api(args.url, args.token)
    console = Console()
    try:
        result = args.ctl(args, api)
    except ApiError as exc:
        print(f"gateway ctl: {exc} (HTTP {exc.status})", file=sys.stderr)
        return 1
    except (httpx.HTTPError, ValueError) as exc:
        print(f"gateway ctl: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    elif isinstance(result, Table):
        console.print(result)
    elif result is not None:
        console.print(result)
    return 0


def parse_weights(pairs: list[str]) -> dict[str, float]:
    weights: dict[str, float] = {}
    for pair in pairs:
        version, sep, percent = pair.partition("=")
        if not sep:
            raise ValueError(f"weight {pair!r} is not VERSION=PERCENT")
        weights[version.strip()] = float(percent)
    return weights


def _policy_table(doc: dict[str, Any]) -> Table:
    table = Table(title=f"policy of {doc['model']} (revision {doc['revision']})")
    table.add_column("version", justify="right")
    table.add_column("weight %", justify="right")
    for version, weight in sorted(doc["weights"].items(), key=lambda kv: target_order(kv[0])):
        table.add_row(version, str(weight))
    for rule in doc.get("rules", []):
        table.add_row(rule["version"], f"rule {rule['header']}: {rule['equals']}")
    if doc.get("sticky_header"):
        table.caption = f"sticky header: {doc['sticky_header']}"
    return table


def _models(args: argparse.Namespace, api: Api) -> Any:
    data = api.call("GET", "/admin/models")
    if args.json:
        return data
    table = Table(title="models")
    for column in ("model", "versions (state)", "weights"):
        table.add_column(column)
    for model in data["models"]:
        versions = ", ".join(f"{v['version']} {v['state']}" for v in model["versions"])
        policy = model["policy"]
        weights = " ".join(f"{v}={w}" for v, w in policy["weights"].items()) if policy else "passthrough"
        table.add_row(model["name"], versions, weights)
    return table


def _fleets(args: argparse.Namespace, api: Api) -> Any:
    data = api.call("GET", "/admin/fleets")
    if args.json:
        return data
    table = Table(title="fleets")
    for column in ("fleet", "server", "health", "in flight", "requests", "errors", "ejections", "refused",
                   "READY versions"):
        table.add_column(column)
    for fleet, servers in sorted(data["fleets"].items()):
        for server in servers:
            health = ("in service" if server["in_service"] else "ejected" if server["ejected"]
                      else "joining" if server["up"] else "down")
            if server.get("last_error") and not server["in_service"]:
                health += f" ({server['last_error'][:60]})"
            ready = "; ".join(f"{model} {','.join(versions)}" for model, versions in server["ready"].items())
            table.add_row(fleet, server["server"], health, f"{server['inflight']} (+{server['queued']} queued)",
                          str(server["requests"]), str(server["errors"]), str(server["ejections"]),
                          str(server["refused"]), ready)
    return table


def _policy_get(args: argparse.Namespace, api: Api) -> Any:
    doc = api.call("GET", f"/admin/models/{args.model}/policy")
    return doc if args.json else _policy_table(doc)


def _policy_set(args: argparse.Namespace, api: Api) -> Any:
    """--file replaces the whole policy. Flags change only what they name: --weights alone is
    a PATCH of the weights; with --sticky-header or --rule, the current policy is read, those
    parts replaced, and written back guarded by the revision read (rules, shadow and sequence
    affinity the flags do not name are kept)."""
    headers = {"If-Match": args.if_match} if args.if_match else None
    if args.file:
        import yaml

        with open(args.file) as handle:
            body = yaml.safe_load(handle)
        doc = api.call("PUT", f"/admin/models/{args.model}/policy", body, headers)
        return doc if args.json else _policy_table(doc)
    if not (args.weights or args.sticky_header or args.rule):
        raise ValueError("give --file, or --weights / --sticky-header / --rule")
    try:
        current = api.call("GET", f"/admin/models/{args.model}/policy")
    except ApiError as exc:
        if exc.status != 404:
            raise
        current = None
    if current is not None and args.weights and not (args.sticky_header or args.rule):
        doc = api.call("PATCH", f"/admin/models/{args.model}/policy/weights",
                       {"weights": parse_weights(args.weights)}, headers)
        return doc if args.json else _policy_table(doc)
    body = {key: current[key] for key in ("weights", "sticky_header", "rules", "shadow", "sequence_affinity")
            if key in current} if current is not None else {}
    if args.weights:
        body["weights"] = parse_weights(args.weights)
    if args.sticky_header:
        body["sticky_header"] = args.sticky_header
    if args.rule:
        body["rules"] = [_parse_rule(rule) for rule in args.rule]
    if "weights" not in body:
        raise ValueError(f"model '{args.model}' has no policy yet: give --weights too")
    expected = args.if_match or f'"{current["revision"] if current is not None else 0}"'
    doc = api.call("PUT", f"/admin/models/{args.model}/policy", body, {"If-Match": expected})
    return doc if args.json else _policy_table(doc)


def _parse_rule(rule: str) -> dict[str, str]:
    header_value, _, version = rule.rpartition(":")
    header, _, value = header_value.partition("=")
    return {"header": header, "equals": value, "version": version}


def _policy_delete(args: argparse.Namespace, api: Api) -> Any:
    return api.call("DELETE", f"/admin/models/{args.model}/policy")


def _weights_set(args: argparse.Namespace, api: Api) -> Any:
    body: dict[str, Any] = {"weights": parse_weights(args.weights)}
    if args.reason:
        body["reason"] = args.reason
    headers = {"If-Match": args.if_match} if args.if_match else None
    doc = api.call("PATCH", f"/admin/models/{args.model}/policy/weights", body, headers)
    return doc if args.json else _policy_table(doc)


def _events(args: argparse.Namespace, api: Api) -> Any:
    params = f"?limit={args.limit}" + (f"&model={args.model}" if args.model else "")
    data = api.call("GET", "/admin/events" + params)
    if args.json:
        return data
    table = Table(title="audit trail")
    for column in ("at", "actor", "action", "model", "reason"):
        table.add_column(column)
    import datetime as dt

    for event in data["events"]:
        at = dt.datetime.fromtimestamp(event["at"], dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(at, event["actor"], event["action"], event["model"], event.get("reason") or "")
    return table


def _rollout_start(args: argparse.Namespace, api: Api) -> Any:
    body: dict[str, Any] = {"canary": args.canary}
    for name in ("stable", "baseline", "interval_s", "max_error_rate", "max_p99_ms", "max_p99_ratio", "min_requests",
                 "failure_limit", "judge", "max_error_rate_increase", "max_client_error_rate_increase",
                 "max_latency_increase", "inconclusive_limit", "critical_error_rate"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    if args.retry:
        body["retry"] = True
    if args.steps:
        body["steps"] = [float(step) for step in args.steps.split(",")]
    if args.manual_gates:
        body["manual_gates"] = True
    if args.rollback or args.rollback_steps:
        body["rollback"] = {"mode": args.rollback or "gradual"}
        if args.rollback_steps:
            body["rollback"]["steps"] = [float(step) for step in args.rollback_steps.split(",")]
    doc = api.call("POST", f"/admin/models/{args.model}/rollout", body)
    return doc if args.json else rollout_view(doc)


def _rollout_command(args: argparse.Namespace, api: Api) -> Any:
    doc = api.call("POST", f"/admin/models/{args.model}/rollout/{args.action}")
    return doc if args.json else rollout_view(doc)


def _rollout_status(args: argparse.Namespace, api: Api) -> Any:
    if not args.watch:
        doc = api.call("GET", f"/admin/models/{args.model}/rollout")
        return doc if args.json else rollout_view(doc)
    import time

    from rich.live import Live

    doc = api.call("GET", f"/admin/models/{args.model}/rollout")
    with Live(rollout_view(doc), refresh_per_second=4) as live:
        while doc["state"] in ("progressing", "paused", "rolling_back"):
            time.sleep(1)
            doc = api.call("GET", f"/admin/models/{args.model}/rollout")
            live.update(rollout_view(doc))
    return doc if args.json else None


def rollout_view(doc: dict[str, Any]) -> Table:
    steps = ", ".join(f"[bold]{s}%[/]" if i == doc["step"] else f"{s}%" for i, s in enumerate(doc["steps"]))
    table = Table(title=f"rollout of {doc['model']}: {doc['state']} (steps {steps})",
                  caption="\n".join([doc["reason"], *_descent_lines(doc), *_evidence_lines(doc), *_hook_lines(doc)]))
    for column in ("version", "role", "weight %", "requests", "error rate", "p99 ms"):
        table.add_column(column, justify="right")
    live = doc.get("live", {})
    roles = [(doc["stable"], "stable"), (doc["canary"], "canary")]
    if doc.get("baseline"):
        roles.insert(1, (doc["baseline"], "baseline"))
    for version, role in roles:
        numbers = live.get(version, {})
        rate = numbers.get("error_rate")
        table.add_row(version, role, str(doc["weights"].get(version, 0)), str(numbers.get("requests", "-")),
                      "-" if rate is None else f"{rate:.2%}", str(numbers.get("p99_ms") or "-"))
    for verdict in doc["verdicts"][-3:]:
        table.add_row("", "verdict", "", str(verdict["canary_requests"]), verdict["outcome"], verdict["reason"][:40])
    return table


def _evidence_lines(doc: dict[str, Any]) -> list[str]:
    """The statistical judge's last word per metric, in its own summary sentences."""
    metrics = doc["verdicts"][-1].get("metrics", []) if doc["verdicts"] else []
    return [f"{metric['verdict'].upper():>12}  {metric['summary']}" for metric in metrics]


def _descent_lines(doc: dict[str, Any]) -> list[str]:
    """Where a gradual rollback is on its way down (the current percent in bold)."""
    descent = doc.get("descent")
    if not descent:
        return []
    canary = doc["weights"].get(doc["canary"], 0)
    path = " -> ".join(f"[bold]{p}%[/]" if p == canary else f"{p}%" for p in descent)
    return [f"rolling back gradually: {path}, one step per {doc['spec']['interval_s']:g} s interval"]


def _hook_lines(doc: dict[str, Any]) -> list[str]:
    """Webhook failures (a webhook never blocks the rollout, so only the status tells)."""
    hooks = doc.get("hooks") or {}
    if not hooks.get("failures"):
        return []
    return [f"webhooks: {hooks['failures']} failed (last: {hooks['last_error']}), {hooks['delivered']} delivered"]
