"""How a rollout goes back to its stable version: gently for the judge's metrics, at once for
critical failures.

``rollback: {mode: gradual, steps: [50, 20, 0]}`` takes a canary the judge found worse than the
stable down through the listed canary percents, one per interval, instead of cutting it to 0 in
one move (a canary at 100% dropped to 0 at once pours all of its traffic onto a stable that may
have been scaled for a few percent). Only the percents below the canary's weight at that moment
are used. A *critical* failure skips the descent, and ends one under way:

- Triton reports the canary not READY, or the canary alone answers "version unavailable"
  (:mod:`gateway.rollout.fast_path`);
- an interval in which the canary's error rate is past ``critical_error_rate`` (see
  :func:`critical_verdict`).

Nothing here does I/O; :mod:`gateway.rollout.steps` moves the rollout, the controller applies it.
"""

from __future__ import annotations

from gateway.rollout import stats
from gateway.rollout.analysis import Outcome, Verdict
from gateway.rollout.spec import RolloutSpec
from gateway.telemetry.recorder import Window

CRITICAL = "critical_error_rate"  # the verdict's metric, and the rollback counter's reason
# A critical rollback skips the statistics and the failure limit, so it must not fire on a few
# unlucky requests: the canary's error rate counts as past the limit only when its one-sided
# 99.9% Clopper-Pearson lower bound is. Against a limit of 0.5: 2 errors in 3 requests (a
# healthy canary with 1% errors gets that in 3 intervals of 10,000) bound at 0.02, 9 in 10 at
# 0.38, and 60 in 100 at 0.44 (the judge's own tests take those); 10 in 10 pass it (0.501),
# and so do 70 in 100 (0.54).
CRITICAL_CONFIDENCE = 0.999


def critical_verdict(spec: RolloutSpec, canary: Window | None, stable: Window | None) -> Verdict | None:
    """An UNHEALTHY verdict when the canary's error rate over this interval is past
    ``critical_error_rate`` (with CRITICAL_CONFIDENCE) and the stable's is not: errors both
    versions share (a Triton-wide burst) are not the canary's own. None otherwise."""
    limit = spec.critical_error_rate
    if limit is None or canary is None or not canary.requests:
        return None
    if stats.rate_lower(canary.errors, canary.requests, CRITICAL_CONFIDENCE) <= limit:
        return None
    stable_rate = stable.error_rate if stable is not None else None
    if stable_rate is not None and stable_rate > limit:
        return None
    rate = canary.errors / canary.requests
    shared = "no stable traffic" if stable_rate is None else f"stable {stable_rate:.2%}"
    return Verdict(Outcome.UNHEALTHY, f"critical: canary error rate {rate:.2%} ({canary.errors} of "
                   f"{canary.requests}) past critical_error_rate {limit:.0%} ({shared}): rolled back at once",
                   CRITICAL, rate, limit, canary_requests=canary.requests, canary_errors=canary.errors,
                   canary_error_rate=rate, stable_requests=stable.requests if stable is not None else 0,
                   stable_error_rate=stable_rate)
