"""What ``gateway ctl`` shows of a rollout: one table, and the lines a pipeline log reads.

Kept apart from the commands so that what a verdict shows (its evidence, its cause) grows in
one place: the table's caption is built from small line functions, one per concern.
"""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table

ACTIVE = ("progressing", "paused", "rolling_back")


def rollout_view(doc: dict[str, Any]) -> Table:
    steps = ", ".join(f"[bold]{s}%[/]" if i == doc["step"] else f"{s}%" for i, s in enumerate(doc["steps"]))
    waiting = waiting_for(doc)
    table = Table(title=f"rollout of {doc['model']}: {doc['state']} (steps {steps})",
                  caption="\n".join([doc["reason"], *([waiting] if waiting else []), *_descent_lines(doc),
                                     *_evidence_lines(doc), *triton_lines(doc), *_variant_lines(doc),
                                     *_hook_lines(doc)]))
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


def history_view(doc: dict[str, Any]) -> Table:
    """The finished rollouts of a model, newest first: when, what, how far, and why it ended."""
    table = Table(title=f"finished rollouts of {doc['model']} (newest first)")
    for column in ("started (UTC)", "took", "canary vs stable", "ended", "verdicts", "why"):
        table.add_column(column)
    for rollout in doc["rollouts"]:
        took = rollout["last_transition_at"] - rollout["started_at"]
        outcomes = [v["outcome"] for v in rollout.get("verdicts", [])]
        table.add_row(_utc(rollout["started_at"]), f"{took:.0f} s", f"{rollout['canary']} vs {rollout['stable']}",
                      f"{rollout['state']} at step {rollout['step'] + 1} of {len(rollout['steps'])}",
                      ", ".join(f"{outcomes.count(o)} {o}" for o in dict.fromkeys(outcomes)) or "none",
                      rollout["reason"])
    if not doc["rollouts"]:
        table.caption = "no finished rollout kept"
    return table


def _utc(at: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def waiting_for(doc: dict[str, Any]) -> str | None:
    """What an active rollout waits for, naming the command that ends the wait (None when it
    waits for nothing but its next interval, or has ended)."""
    model, state = doc["model"], doc["state"]
    if state == "paused":
        return (f"paused, and waits for a person: `gateway ctl rollout resume {model}` goes on from step "
                f"{doc['step'] + 1}, `promote` moves to the next step, `abort` sends everything back to "
                f"{doc['stable']}")
    if state not in ACTIVE:
        return None
    warmup = doc.get("warmup") or {}
    if state == "progressing" and warmup.get("state") == "warming":
        return f"warms up on mirrored traffic before step 1: {warmup.get('test')}"
    if doc.get("awaiting_promote"):
        return (f"healthy at step {doc['step'] + 1}, and waits for `gateway ctl rollout promote {model}` "
                f"(manual_gates)")
    if not doc.get("applied", True):
        return f"waits for the policy to show this step's weights: {doc.get('apply_reason', '')}"
    last = doc["verdicts"][-1] if doc["verdicts"] else None
    if last is not None and last["outcome"] == "inconclusive" and last.get("step") == doc["step"]:
        return f"waits for more evidence: {last['reason']}"
    return None


def progress_line(doc: dict[str, Any]) -> str:
    """One line for a log: state, step and canary weight, reason (and what it waits for)."""
    canary = doc["weights"].get(doc["canary"], 0)
    line = f"{doc['model']}: {doc['state']}, step {doc['step'] + 1} of {len(doc['steps'])}, canary " \
           f"{doc['canary']} at {canary}%: {doc['reason']}"
    waiting = waiting_for(doc)
    return f"{line}; {waiting}" if waiting else line


def _variant_lines(doc: dict[str, Any]) -> list[str]:
    """A canary inside an ensemble: its variant, where it stands, and the composing model's versions in Triton."""
    variant = doc.get("variant") or {}
    if not variant:
        return []
    lines = [f"variant {variant['name']} of ensemble {variant['ensemble']}: {variant['model']} "
             f"{variant['stable_version']} -> {variant['canary_version']} ({variant.get('state') or 'planned'})"]
    attribution = variant.get("attribution") or {}
    if attribution.get("summary"):
        lines.append(attribution["summary"])
    return lines


def _evidence_lines(doc: dict[str, Any]) -> list[str]:
    """The statistical judge's last word per metric, in its own summary sentences."""
    metrics = doc["verdicts"][-1].get("metrics", []) if doc["verdicts"] else []
    return [f"{metric['verdict'].upper():>12}  {metric['summary']}" + (f"\n{'':>14}{escape(metric['words'])}"
            if metric.get("words") else "") for metric in metrics]


def triton_lines(doc: dict[str, Any]) -> list[str]:
    """Triton's own view (issue 34): where the last interval's difference lies, the configs compared
    at the start, a server serving the canary otherwise, the warm-up."""
    lines = []
    warmup = doc.get("warmup") or {}
    if warmup:
        lines.append(f"warm-up: {warmup.get('state')} ({warmup.get('test')})")
    attribution = doc["verdicts"][-1].get("attribution") if doc["verdicts"] else None
    if attribution:
        lines.append(f"in Triton: {attribution['summary']}")
    words = (doc.get("likeness") or {}).get("words")
    if words and words != "configs alike":
        lines.append(f"like for like: {words}")
    lines.extend(f"drift: {entry['words']}" for entry in doc.get("drift") or ())
    return lines


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
