"""What a rollout spec says about custom checks: PromQL queries with limits, the gateway's
counterpart of Argo's AnalysisTemplate and Flagger's MetricTemplate. Validated here, so a
check without a limit, a duplicate name or an unknown placeholder is a 422 at
``POST /admin/models/{model}/rollout`` and never an error found mid-rollout.

A query names the rollout through placeholders, replaced each interval by
:func:`render`: ``{model}``, ``{canary}``, ``{stable}`` (escaped for a double-quoted PromQL
string, e.g. ``version="{canary}"``) and ``{interval}`` (the rollout's interval as a PromQL
duration, e.g. ``30s``, for ``rate(...[{interval}])``). No PromQL expression contains a
lone ``{word}`` (a selector needs a matcher), so the placeholders cannot be mistaken for
label matchers.
"""

from __future__ import annotations

import math
import re

from pydantic import BaseModel, ConfigDict, Field, model_validator

PLACEHOLDERS = ("model", "canary", "stable", "interval")
MAX_QUERY = 4096  # characters: a query is one expression, not a program
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


class Check(BaseModel):
    """One PromQL query whose single value must stay within ``max`` and/or ``min``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$", description="shown in the status and in the "
                      "rollback reason")
    query: str = Field(min_length=1, max_length=MAX_QUERY, description="PromQL, evaluated as an instant query each "
                       "interval; placeholders {model} {canary} {stable} {interval}")
    max: float | None = Field(None, allow_inf_nan=False, description="the check fails when the value is above")
    min: float | None = Field(None, allow_inf_nan=False, description="the check fails when the value is below")

    @model_validator(mode="after")
    def _limited(self) -> Check:
        if self.max is None and self.min is None:
            raise ValueError(f"check {self.name!r} needs a limit: max, min or both (a band)")
        if self.max is not None and self.min is not None and self.min > self.max:
            raise ValueError(f"check {self.name!r}: min {self.min:g} is above max {self.max:g}")
        if not self.query.strip():
            raise ValueError(f"check {self.name!r}: the query is blank")
        unknown = sorted({m for m in _PLACEHOLDER.findall(self.query) if m not in PLACEHOLDERS})
        if unknown:
            raise ValueError(f"check {self.name!r}: unknown placeholder {{{unknown[0]}}}; the known ones are "
                             + " ".join(f"{{{p}}}" for p in PLACEHOLDERS))
        return self

    def breached(self, value: float) -> bool:
        return (self.max is not None and value > self.max) or (self.min is not None and value < self.min)

    def limit_words(self) -> str:
        if self.max is not None and self.min is not None:
            return f"between {self.min:g} and {self.max:g}"
        return f"max {self.max:g}" if self.max is not None else f"min {self.min:g}"


def unique_names(checks: list[Check]) -> list[Check]:
    names = [check.name for check in checks]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"check names must be unique: {', '.join(repeated)} repeated")
    return checks


def promql_string(value: str) -> str:
    """``value`` escaped for the inside of a double-quoted PromQL string (Go's escapes: the
    PromQL lexer accepts ``\\\\``, ``\\"`` and the control escapes, nothing else)."""
    out = value.replace("\\", "\\\\").replace('"', '\\"')
    return out.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def promql_duration(seconds: float) -> str:
    return f"{max(1, math.ceil(seconds))}s"


def render(query: str, model: str, canary: str, stable: str, interval_s: float) -> str:
    """The query with its placeholders replaced (in one pass: a value is never re-scanned)."""
    values = {"model": promql_string(model), "canary": promql_string(canary), "stable": promql_string(stable),
              "interval": promql_duration(interval_s)}
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), query)
