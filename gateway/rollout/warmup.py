"""Warm before weight (rollout spec ``warmup``): a freshly loaded canary is slower for its first
seconds or minutes (lazy initialisation, caches, JIT; Triton server #8085, #5326, #5129), and a
judge that compares it with a warm stable from its first interval rolls back a good version, while
one that skips its first seconds (``latency_warmup_s``) guesses how long that is.

With ``warmup``, the rollout first mirrors ``percent`` of the model's live requests to the canary
(the shadow machinery: :mod:`gateway.proxy.shadow`; the canary's answers are dropped, clients
never see them) while the canary takes no weight. Every ``window_s`` the controller closes a
window of the mirrored answers and takes their median latency. **The stated test**: the canary is
steady when each of the last ``windows`` windows holds at least ``min_requests`` answers and their
medians lie within ``tolerance`` of each other (largest / smallest - 1 <= tolerance). Then its
first step starts, and its latency is judged from the first interval (``latency_warmup_s`` does not
apply: the warm-up showed it warm). If the test has not passed after ``max_s`` seconds, the
rollout does what ``on_timeout`` says: ``proceed`` to its first step anyway (``latency_warmup_s``
then applies as usual), or ``pause`` for an operator. The windows and the test's words are kept
in the rollout's record (``warmup``).

What the test cannot see: a cold start that stays flat (slow, but steadily so) for longer than
the windows span, then drops, reads as steady on its plateau: nothing in the canary's own latency
tells a plateau from its warm level. Let ``windows`` x ``window_s`` span longer than the flat
part of the cold starts expected (the defaults span 15 s).

Nothing here does I/O: the controller takes the windows (:class:`WarmupWindows`) off the
recorder's shadow counters, :func:`steadiness` judges them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.telemetry.recorder import LATENCY_BOUNDS, Window

KEEP_WINDOWS = 30  # windows kept in the record (the test reads the last few)


class WarmupSpec(BaseModel):
    """``warmup`` in a rollout spec (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    percent: Annotated[Decimal, Field(gt=0, le=100, decimal_places=2)] = Field(
        Decimal(10), description="share of the model's live requests mirrored to the canary while it warms up")
    window_s: float = Field(5.0, ge=0.5, le=600, description="seconds per window of mirrored answers")
    windows: int = Field(3, ge=2, le=20, description="the last this many windows must agree")
    min_requests: int = Field(20, ge=1, le=100_000, description="mirrored answers a window needs to count")
    tolerance: float = Field(0.2, gt=0, le=10, description="steady: the windows' medians within this ratio of "
                             "each other (largest / smallest - 1)")
    max_s: float = Field(300.0, ge=1, le=86_400, description="the warm-up's time limit")
    on_timeout: Literal["proceed", "pause"] = Field(
        "pause", description="past max_s without passing the test: take the first step anyway (latency_warmup_s "
        "then applies), or pause for an operator")


def median_ms(histogram: Sequence[int]) -> float | None:
    """The median of a latency histogram (LATENCY_BOUNDS buckets), in ms, as Window.quantile takes it."""
    value = Window("", "", 0.0, 0, 0, 0, tuple(histogram)).quantile(0.5)
    return None if value is None else round(value * 1000, 3)


class WarmupWindows:
    """The controller's memory of the open window per model: the shadow counters at its start."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[float, int, int, tuple[int, ...]]] = {}  # model -> (start, requests, errors, hist)

    def forget(self, model: str) -> None:
        self._open.pop(model, None)

    def close(self, model: str, now: float, window_s: float, requests: int, errors: int,
              histogram: Sequence[int]) -> dict[str, Any] | None:
        """The window that ended now, if one did (from the cumulative shadow counters given); the
        first call only opens one."""
        current = (now, requests, errors, tuple(histogram))
        opened = self._open.get(model)
        if opened is None:
            self._open[model] = current
            return None
        start, before_requests, before_errors, before_hist = opened
        if now - start < window_s:
            return None
        self._open[model] = current
        delta = [max(0, a - b) for a, b in zip(histogram, before_hist)]
        if len(delta) != len(LATENCY_BOUNDS) + 1:
            return None
        return {"at": now, "seconds": round(now - start, 3), "requests": max(0, requests - before_requests),
                "errors": max(0, errors - before_errors), "median_ms": median_ms(delta)}


def steadiness(spec: WarmupSpec, windows: Sequence[Mapping[str, Any]]) -> tuple[bool, str]:
    """The stated test over the last ``spec.windows`` windows, and what it found, in words."""
    recent = list(windows)[-spec.windows:]
    if len(recent) < spec.windows:
        return False, f"{len(recent)} of {spec.windows} windows of {spec.window_s:g} s so far"
    thin = [w for w in recent if w["requests"] < spec.min_requests or w["median_ms"] is None]
    medians = [float(w["median_ms"]) for w in recent if w["median_ms"] is not None]
    shown = ", ".join(f"{m:.2f}" for m in medians)
    if thin:
        return False, (f"{len(thin)} of the last {spec.windows} windows had fewer than {spec.min_requests} "
                       f"mirrored answers (medians {shown} ms)")
    low, high = min(medians), max(medians)
    spread = high / low - 1 if low > 0 else (0.0 if high == 0 else float("inf"))
    return spread <= spec.tolerance, (f"medians of the last {spec.windows} windows {shown} ms: largest / smallest "
                                      f"- 1 = {spread:.0%}, tolerance {spec.tolerance:.0%}")
