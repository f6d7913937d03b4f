"""A verdict's evidence in words, beside its numbers.

The judge's summaries say "evidence 530112x, needed 600x": right, and opaque to anyone who has
not read about e-values. Here each metric's verdict gets a sentence a person reads at 3 a.m.:
what was seen (the effect and its 95% interval against the floor) and how sure the judge is,
as how many times likelier the data are if the canary is worse than if it is as good as its
reference, against the bar a rollback needs (a canary as good as its reference reaches that bar
in at most 1 rollout in that many). Pure functions over the verdict documents; the rollout's
status (API, ``gateway ctl``) and the console both show them. A new kind of evidence (e.g. where
a latency difference lies: Triton's queue or compute) adds a clause in :func:`metric_words`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LABELS = {"error_rate": "Error rate", "client_error_rate": "4xx rate", "latency": "Latency",
          "capacity_error_rate": "REJECTED rate (its queue full or timed out)",
          "time_to_first_response": "Time to first response", "response_gap": "Gap between responses",
          "error_ceiling": "Error rate against max_error_rate", "shadow_agreement": "Agreement with the primary"}
RATES = ("error_rate", "client_error_rate", "capacity_error_rate")
LATENCIES = ("latency", "time_to_first_response", "response_gap")


def _times(value: float) -> str:
    if value >= 1_000_000:
        return "over a million times"
    if value >= 100:
        return f"{value:,.0f} times"
    return f"{value:.1f} times" if value >= 1 else f"{value:.2f} times"


def _points(value: float) -> str:
    return f"{value * 100:+.2f} points"


def _seen(metric: Mapping[str, Any], versus: str) -> str | None:
    """The effect and its interval against the floor, in the metric's own unit."""
    name, effect, low, high, floor = (metric.get(k) for k in ("name", "effect", "low", "high", "floor"))
    if effect is None or floor is None:
        return None
    if name in RATES:
        interval = f" (95% interval {_points(low)} to {_points(high)})" if low is not None and high is not None else ""
        return f"the canary's rate is {_points(effect)} against the {versus}'s{interval}; the floor is {_points(floor)}"
    if name in LATENCIES:
        interval = f" (95% interval {low:+.0%} to {high:+.0%})" if low is not None and high is not None else ""
        return f"the canary's median is {effect:+.0%} against the {versus}'s{interval}; the floor is {floor:+.0%}"
    if name == "error_ceiling":
        return f"the canary fails {effect:.2%} of its requests; the ceiling is {floor:.2%}"
    return None


def metric_words(metric: Mapping[str, Any], versus: str = "stable") -> str:
    """One metric's verdict in plain words (its ``summary`` keeps the numbers)."""
    label = LABELS.get(str(metric.get("name")), str(metric.get("name", "a check")).removeprefix("check:"))
    verdict, e_value, needed = metric.get("verdict"), metric.get("e_value"), metric.get("e_threshold")
    seen = _seen(metric, versus)
    if verdict not in ("fail", "pass", "inconclusive") or e_value is None or not needed:
        return f"{label}: {metric.get('summary', verdict)}"
    bar = (f"the judge rolls back from {_times(needed)}, a bar a canary as good as the {versus} reaches in at most "
           f"1 rollout in {needed:,.0f}")
    if verdict == "fail":
        return (f"{label} is worse: " + (f"{seen}. " if seen else "") + f"The data are {_times(e_value)} likelier if "
                f"the canary is worse than if it is as good as the {versus}; {bar}.")
    if verdict == "pass":
        return f"{label} is fine: " + (f"{seen}, and the judge is sure it stays within it." if seen else
                                        "within its limit.")
    needs = metric.get("requests_needed")
    more = (f" About {needs:,} more canary requests should decide it." if needs else
            " The effect sits on the floor: no number of requests will decide it." if seen else "")
    lean = (f"the data are {_times(e_value)} likelier if the canary is worse, {e_value / needed:.0%} of the way to "
            f"the {_times(needed)} a rollback needs" if e_value >= 1 else
            f"the data lean towards the canary being as good as the {versus}")
    return f"{label} is not decided yet: " + (f"{seen}; " if seen else "") + f"{lean}.{more}"


def with_words(verdict: Mapping[str, Any], versus: str = "stable") -> dict[str, Any]:
    """A verdict document whose metrics each carry ``words``; a latency's say where Triton's own
    statistics put the difference (``attribution.cause``), when they could be read."""
    cause = (verdict.get("attribution") or {}).get("cause")
    where = f" Triton's own statistics put the difference in {'the ' if cause != 'outside Triton' else ''}{cause}." \
        if cause else ""
    return {**verdict, "metrics": [{**m, "words": metric_words(m, versus) + (where if m.get("name") in LATENCIES
                                                                             and m.get("verdict") != "pass" else "")}
                                   for m in verdict.get("metrics") or []]}


def with_words_all(rollout: Mapping[str, Any]) -> dict[str, Any]:
    """A rollout document whose verdicts' metrics each carry ``words``."""
    versus = "baseline" if rollout.get("baseline") else "stable"
    return {**rollout, "verdicts": [with_words(v, versus) for v in rollout.get("verdicts") or []]}
