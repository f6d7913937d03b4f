"""The rollout-spec reference and the rollout's transitions, generated from the models
(``gateway rollout-reference``; docs/rollout-spec.md and docs/rollouts.md embed them)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from gateway.rollout.check_spec import Check
from gateway.rollout.hook_spec import Gate, Webhook
from gateway.rollout.phases import ALLOWED, Phase
from gateway.rollout.rollback_spec import FailureClasses, RollbackSpec
from gateway.rollout.spec import STATISTICAL_ONLY, THRESHOLDS_ONLY, RolloutSpec
from gateway.rollout.warmup import WarmupSpec

SPEC_BEGIN = "<!-- rollout-spec-reference:begin -->"
SPEC_END = "<!-- rollout-spec-reference:end -->"
TRANSITIONS_BEGIN = "<!-- rollout-transitions:begin -->"
TRANSITIONS_END = "<!-- rollout-transitions:end -->"

# Why each allowed phase change happens (the table below must name every edge of phases.ALLOWED
# and no other: tests/unit/test_docs.py).
TRANSITIONS: dict[tuple[Phase, Phase], str] = {
    (Phase.PROGRESSING, Phase.PROGRESSING): "a healthy interval moves to the next step (with `manual_gates`, "
    "only after a `promote`); an unhealthy or inconclusive one holds the step, and so does a server of the "
    "canary's fleet serving it with another config; a `warmup` whose test passed (or whose `max_s` ran out, "
    "`on_timeout: proceed`) starts step 1",
    (Phase.PROGRESSING, Phase.PAUSED): "`pause`; a policy change the rollout did not make (a human's); "
    "`error_limit` metric read errors or `inconclusive_limit` undecided intervals in a row; the baseline "
    "stopped being READY; `failure_limit` unhealthy intervals of a class `failure_classes` pauses on "
    "(capacity: \"canary under-provisioned: queue\"); a `warmup` past `max_s` with `on_timeout: pause`",
    (Phase.PROGRESSING, Phase.PROMOTED): "the last step was healthy, or `promote` at the last step",
    (Phase.PROGRESSING, Phase.ROLLED_BACK): "`failure_limit` unhealthy intervals in a row (immediate rollback), "
    "an interval past `critical_error_rate`, the fast path (the canary alone not READY or unavailable), a gate "
    "with `on_failure: rollback`",
    (Phase.PROGRESSING, Phase.ROLLING_BACK): "`failure_limit` unhealthy intervals in a row with "
    "`rollback.mode: gradual`",
    (Phase.PROGRESSING, Phase.ABORTED): "`abort`: everything back to the stable at once",
    (Phase.ROLLING_BACK, Phase.ROLLING_BACK): "one rollback step down per interval",
    (Phase.ROLLING_BACK, Phase.ROLLED_BACK): "the last rollback step (0%), a critical failure (at once), or a "
    "human's policy change (left as set)",
    (Phase.ROLLING_BACK, Phase.ABORTED): "`abort`: the canary to 0% at once",
    (Phase.PAUSED, Phase.PROGRESSING): "`resume`",
    (Phase.PAUSED, Phase.PROMOTED): "`promote`",
    (Phase.PAUSED, Phase.ROLLED_BACK): "allowed by the table, made by nothing today: the controller leaves a "
    "paused rollout alone (failures seen while paused never roll a resumed canary back)",
    (Phase.PAUSED, Phase.ABORTED): "`abort`",
}


def _default(field: Any) -> str:
    default = field.default
    if default is PydanticUndefined:
        if field.default_factory is None:
            return "required"
        default = field.default_factory()
    if isinstance(default, BaseModel):
        return "see below"
    if default is None:
        return "unset"
    return f"`{json.dumps(default, default=lambda d: float(d) if d != int(d) else int(d))}`"


def _type(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("decimal.", "").replace("gateway.rollout.", "") \
        .replace("Annotated[Decimal, ...]", "Percent")


def _judge(name: str) -> str:
    return "thresholds" if name in THRESHOLDS_ONLY else "statistical" if name in STATISTICAL_ONLY else "both"


def fields_table(model: type[BaseModel], prefix: str = "", judges: bool = False) -> str:
    header = ["field", "default", *(["judge"] if judges else []), "meaning"]
    rows = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for name, field in model.model_fields.items():
        cells = [f"`{prefix}{name}`", _default(field), *([_judge(name)] if judges else []),
                 (field.description or "").replace("|", "\\|")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def spec_markdown() -> str:
    parts = [fields_table(RolloutSpec, judges=True)]
    for title, model, prefix in (("`rollback`", RollbackSpec, "rollback."),
                                 ("`failure_classes`", FailureClasses, "failure_classes."),
                                 ("`warmup`", WarmupSpec, "warmup."), ("each of `webhooks`", Webhook, ""),
                                 ("each of `gates`", Gate, ""), ("each of `checks`", Check, "")):
        parts += [f"**{title}**", fields_table(model, prefix)]
    return "\n\n".join(parts)


def transitions_markdown() -> str:
    rows = ["| from | to | when |", "| --- | --- | --- |"]
    for current, targets in ALLOWED.items():
        for target in sorted(targets, key=list(Phase).index):
            rows.append(f"| `{current.value}` | `{target.value}` | {TRANSITIONS[(current, target)]} |")
    return "\n".join(rows)


def embedded(text: str, begin: str, end: str) -> str:
    return text.split(begin, 1)[1].split(end, 1)[0].strip()


def markdown() -> str:
    return f"{SPEC_BEGIN}\n{spec_markdown()}\n{SPEC_END}\n\n{TRANSITIONS_BEGIN}\n{transitions_markdown()}\n" \
           f"{TRANSITIONS_END}"
