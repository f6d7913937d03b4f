"""``gateway ctl``: the SRE's command line for the admin API.

Human tables by default (rich), ``--json`` for scripts. Exit codes: 0 done, 1 the API said
no (its message is printed, naming the flags the CLI sent rather than the JSON fields), 2 bad
usage or the gateway unreachable; ``rollout status --watch`` has its own (gateway/ctl/rollout.py).
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
from rich.markup import escape
from rich.table import Table

from gateway.ctl.api import Api, ApiError
from gateway.ctl.rollout import Exit, add_rollout_parser, in_cli_words, print_exit
from gateway.policy import target_order

Handler = Callable[[argparse.Namespace, "Api"], Any]


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
    wset.set_defaults(ctl=_weights_set, flags={"reason": "--reason", "weights": "V=PCT"})

    versions = sub.add_parser("versions", help="load or unload a version on Triton (every server of its fleet)") \
        .add_subparsers(metavar="ACTION", required=True)
    load = versions.add_parser("load", help="load a version beside the serving ones; done once it is READY",
                               description="POST /admin/models/{model}/versions/{version}/load. Without --config, "
                               "what is sent to Triton depends on model_repository (docs/lifecycle.md); the answer "
                               "says what was sent.")
    load.add_argument("model")
    load.add_argument("version")
    load.add_argument("--config", metavar="FILE", help="the model configuration to load with (Triton's JSON form "
                      "of config.pbtxt, as JSON or YAML)")
    load.set_defaults(ctl=_version_load, flags={"config": "--config"})
    unload = versions.add_parser("unload", help="take a version out of every policy, drain it, then unload it",
                                 description="POST /admin/models/{model}/versions/{version}/unload: refused (409) "
                                 "while a rollout or a policy uses the version, or sequences stay pinned to it.")
    unload.add_argument("model")
    unload.add_argument("version")
    unload.set_defaults(ctl=_version_unload)

    add_rollout_parser(sub)

    events = sub.add_parser("events", help="the audit trail, newest first")
    events.add_argument("--model")
    events.add_argument("--limit", type=int, default=20)
    events.set_defaults(ctl=_events)
    ctl.set_defaults(handler=run_ctl)


def run_ctl(args: argparse.Namespace) -> int:
    api = Api(args.url, args.token)
    console = Console()
    try:
        result = args.ctl(args, api)
    except ApiError as exc:
        print(f"gateway ctl: {in_cli_words(str(exc), getattr(args, 'flags', {}))} (HTTP {exc.status})",
              file=sys.stderr)
        return 1
    except (httpx.HTTPError, ValueError) as exc:
        print(f"gateway ctl: {exc}", file=sys.stderr)
        return 2
    for warning in api.warnings:  # on stderr: a script reading --json on stdout still sees them
        print(f"gateway ctl: note: {in_cli_words(warning, getattr(args, 'flags', {}))}", file=sys.stderr)
    if isinstance(result, Exit):
        return print_exit(result, args.json)
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
    for column in ("at", "actor", "action", "model", "reason", "changes"):
        table.add_column(column)
    import datetime as dt

    for event in data["events"]:
        at = dt.datetime.fromtimestamp(event["at"], dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(at, event["actor"], event["action"], event["model"], event.get("reason") or "",
                      escape("\n".join(change["words"] for change in event.get("changes") or [])))
    return table


def _version_load(args: argparse.Namespace, api: Api) -> Any:
    body = None
    if args.config:
        import yaml

        with open(args.config) as handle:
            body = {"config": yaml.safe_load(handle)}
    doc = api.call("POST", f"/admin/models/{args.model}/versions/{args.version}/load", body)
    return doc if args.json else _version_summary(doc, f"version {args.version} of {args.model} loaded")


def _version_unload(args: argparse.Namespace, api: Api) -> Any:
    doc = api.call("POST", f"/admin/models/{args.model}/versions/{args.version}/unload")
    return doc if args.json else _version_summary(doc, f"version {args.version} of {args.model} unloaded")


def _version_summary(doc: Any, done: str) -> str:
    sent = doc.get("config_sent") if isinstance(doc, dict) else None
    return done + (f" (sent to Triton: {sent})" if sent else "")
