"""``gateway ctl rollout ...``: start, status (``--watch`` can gate a pipeline), promote, pause,
resume, abort.

``status --watch`` exit codes: 0 promoted, 1 rolled back or aborted, 2 ``--timeout`` passed,
3 an error (the gateway unreachable, no such model or rollout, a usage error).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, NoReturn

import httpx
from rich.console import Console

from gateway.ctl.api import Api, ApiError
from gateway.ctl.views import ACTIVE, history_view, progress_line, rollout_view, waiting_for

PROMOTED, REJECTED, TIMED_OUT, FAILED = 0, 1, 2, 3
FINAL_EXIT = {"promoted": PROMOTED, "rolled_back": REJECTED, "aborted": REJECTED}
POLL_S = 1.0


@dataclass(frozen=True)
class Exit:
    """A command's own exit code, with the document it ended on (printed with --json)."""

    code: int
    doc: dict[str, Any] | None
    message: str


def add_rollout_parser(sub: Any) -> None:
    rollout = sub.add_parser("rollout", help="progressive rollouts: start, status [--watch], promote, pause, "
                             "resume, abort").add_subparsers(metavar="ACTION", required=True)
    start = rollout.add_parser("start", help="start moving traffic to a canary step by step")
    start.add_argument("model")
    target = start.add_mutually_exclusive_group(required=True)
    target.add_argument("--canary", help="the new target: a version (3), fleet:version, another model (qc_2026_12) "
                        "or model@version (qc_2026_12@2)")
    target.add_argument("--composing", metavar="MODEL@VERSION", help="MODEL is an ensemble: canary this composing "
                        "model's version inside it (qc@3): the gateway loads a variant of the ensemble pinning it, "
                        "splits the ensemble between the two, and on promotion pins it in the ensemble itself")
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
    start.set_defaults(ctl=_rollout_start, flags=_flags(start, {"rollback.mode": "--rollback",
                                                                "rollback.steps": "--rollback-steps"}))
    status = rollout.add_parser(
        "status", help="state, weights, verdicts; --watch follows it until it ends",
        description="Show a rollout. With --watch, follow it until it ends and exit 0 when it was promoted, 1 when "
        "it was rolled back or aborted, 2 when --timeout passed first, 3 on an error: a CI/CD step can gate on it.")
    status.add_argument("model")
    status.add_argument("--watch", action="store_true", help="refresh every second until the rollout ends (on a "
                        "terminal a live table, else one line per change)")
    status.add_argument("--timeout", type=float, metavar="SECONDS", help="with --watch: give up after this long "
                        "(exit 2); a paused rollout waits for a person, so a pipeline should set one")
    status.set_defaults(ctl=_rollout_status)
    # A usage error of the watch is an error (3): argparse's own 2 would read as a timeout.
    setattr(status, "error", lambda message: _usage_error(status, message))  # noqa: B010
    history = rollout.add_parser("history", help="the model's finished rollouts, newest first, with why each ended",
                                 description="GET /admin/models/{model}/rollouts: every finished rollout kept (the "
                                 "newest rollout_history_per_model), with its verdicts and evidence (--json).")
    history.add_argument("model")
    history.add_argument("--limit", type=int, default=20, help="at most this many (20)")
    history.set_defaults(ctl=_rollout_history)
    for action, text in (("promote", "go to the next step now"), ("pause", "hold the current step"),
                         ("resume", "continue a paused rollout"), ("abort", "send everything back to stable"),
                         ("acknowledge", "say a finished rollback was seen (it leaves the console's Needs "
                          "attention)")):
        command = rollout.add_parser(action, help=text)
        command.add_argument("model")
        command.set_defaults(ctl=_rollout_command, action=action)


def _usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.print_usage(sys.stderr)
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    sys.exit(FAILED)


def _flags(parser: argparse.ArgumentParser, extra: dict[str, str]) -> dict[str, str]:
    """API field -> the flag that sets it, read from the parser itself so the two cannot drift."""
    flags = {action.dest: action.option_strings[0] for action in parser._actions
             if action.option_strings and action.dest != "help"}
    return {**flags, **extra}


def in_cli_words(message: str, flags: dict[str, str]) -> str:
    """The API's message, with each JSON field the CLI set named by its flag: `"retry": true`
    becomes `--retry`, a 422's `interval_s: ...` becomes `--interval: ...`."""
    def setting(match: re.Match[str]) -> str:
        flag = flags.get(match.group(1))
        if flag is None:
            return match.group(0)
        return flag if match.group(2) == "true" else f"{flag} {match.group(2).strip(chr(34))}"

    message = re.sub(r'"(\w+)":\s*(true|false|-?[\d.]+|"[^"]*")', setting, message)

    def field(match: re.Match[str]) -> str:
        path = match.group(1)
        for candidate in (path, path.split(".")[0]):
            if candidate in flags:
                return flags[candidate]
        return path

    return re.sub(r"(?<![\w.-])([a-z_]+(?:\.[\w]+)*)(?=: )", field, message)


def _rollout_start(args: argparse.Namespace, api: Api) -> Any:
    body: dict[str, Any] = {"canary": args.canary} if args.canary else {"composing": args.composing}
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


def _rollout_history(args: argparse.Namespace, api: Api) -> Any:
    doc = api.call("GET", f"/admin/models/{args.model}/rollouts?limit={args.limit}")
    return doc if args.json else history_view(doc)


def _rollout_command(args: argparse.Namespace, api: Api) -> Any:
    doc = api.call("POST", f"/admin/models/{args.model}/rollout/{args.action}")
    return doc if args.json else rollout_view(doc)


def _rollout_status(args: argparse.Namespace, api: Api) -> Any:
    if not args.watch:
        doc = api.call("GET", f"/admin/models/{args.model}/rollout")
        return doc if args.json else rollout_view(doc)
    return watch(api, args.model, args.timeout, Console(stderr=False), quiet=args.json)


def watch(api: Api, model: str, timeout: float | None, console: Console, quiet: bool = False) -> Exit:
    """Follow the rollout until it ends or ``timeout`` passes: a live table on a terminal, one
    line per change otherwise (a pipeline's log), nothing with --json (the last document at the end)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    shown: str | None = None
    live = None
    try:
        doc = api.call("GET", f"/admin/models/{model}/rollout")
        if console.is_terminal and not quiet:
            from rich.live import Live

            live = Live(rollout_view(doc), console=console, refresh_per_second=4)
            live.start()
        while True:
            line = progress_line(doc)
            if live is not None:
                live.update(rollout_view(doc))
            elif not quiet and line != shown:
                console.print(line, markup=False, highlight=False, soft_wrap=True)
            shown = line
            if doc["state"] not in ACTIVE:
                code = FINAL_EXIT.get(doc["state"], FAILED)
                return Exit(code, doc, f"{model}: {doc['state']}: {doc['reason']}")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                waiting = waiting_for(doc)
                return Exit(TIMED_OUT, doc, f"gateway ctl: --timeout {timeout:g} s passed; the rollout of {model} is "
                            f"still {doc['state']} at step {doc['step'] + 1} of {len(doc['steps'])}"
                            + (f": {waiting}" if waiting else f": {doc['reason']}"))
            time.sleep(POLL_S if left is None else max(0.0, min(POLL_S, left)))
            doc = api.call("GET", f"/admin/models/{model}/rollout")
    except ApiError as exc:
        return Exit(FAILED, None, f"gateway ctl: {exc} (HTTP {exc.status})")
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return Exit(FAILED, None, f"gateway ctl: {exc!r}")
    finally:
        if live is not None:
            live.stop()


def print_exit(result: Exit, as_json: bool) -> int:
    if as_json and result.doc is not None:
        print(json.dumps(result.doc, indent=2))
    print(result.message, file=sys.stderr if result.code or as_json else sys.stdout)
    return result.code
