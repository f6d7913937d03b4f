"""Where a canary's difference lies, in Triton's own terms: pure functions, no I/O.

The judge compares what the gateway sees of two versions (errors, end-to-end latency); Triton
knows what each version did inside it (``services.engine_stats``). Over one interval, per
version (summed over the servers of its fleet):

* **queue**: mean time a request waited in the scheduler's queue (cache hits included: they
  queue too);
* **compute**: mean time of compute_input + compute_infer + compute_output per request that ran
  in the backend (cache hits do not);
* **batch**: inferences per execution, the batch size the version ran at;
* **cache**: response-cache hits and misses, counted apart: a hit is answered without compute,
  so hits are taken out of the latencies the judge compares (:func:`without_cache_hits`).

A latency difference is put down to one cause (:func:`latency_cause`): **compute** when the
canary's own compute per request is worse beyond the floor and accounts for at least
COMPUTE_SHARE of the increase inside Triton (its queue growing too is then a consequence: a
slower model also queues more, a few times its compute's growth under load), else **queue** when
its queue time is worse beyond the floor (the same work waits longer: fewer instances, a batcher
that waits for batches; capacity, which the spec may pause on rather than roll back; a batch that
grows with the wait makes compute per request grow a little too, which does not make it the
cause), else **outside Triton** when the end-to-end difference is not in Triton at all (the
network, the gateway, the clients). A client cannot move Triton's means by its own slow
reads or its own deadlines: Triton's timings end when the response is handed back and count only
requests that completed, so such a difference can only ever be put outside Triton.

Errors are classed by Triton's own words for them (``telemetry.recorder``): REJECTED (the
version's queue was full or its timeout ran out: capacity) and BACKEND (the model failed,
or anything else the version answered with a 5xx). The words are said only of a verdict that
found the canary's errors worse (``rollout.engine.with_attribution``): a client's own failures
(its own tiny queue timeout, say) are capped by the judge like any client's and make no verdict
say that the canary's queue refused them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gateway.services.engine_stats import EngineCounters, TargetInterval

MIN_SHIFT_MS = 0.05  # a part of a difference smaller than this is noise at Triton's microsecond counters
COMPUTE_SHARE = 0.25  # of the increase inside Triton, what slower compute must account for to be the cause
QUEUE, COMPUTE, OUTSIDE = "queue", "compute", "outside Triton"


@dataclass(frozen=True)
class EngineView:
    """One version's interval in Triton, as means per request."""

    requests: int  # Triton's successes and failures
    failures: int
    queue_ms: float | None
    compute_ms: float | None
    compute_input_ms: float | None
    compute_infer_ms: float | None
    compute_output_ms: float | None
    batch: float | None  # inferences per execution
    cache_hits: int
    cache_misses: int

    @property
    def hit_share(self) -> float:
        """Share of the version's successful requests answered from the cache."""
        looked_up = self.cache_hits + self.cache_misses
        return self.cache_hits / looked_up if looked_up else 0.0


def view(counters: EngineCounters) -> EngineView:
    """Means per request of one version's interval counters."""
    computed = counters.compute_count

    def per(ns: int, count: int) -> float | None:
        return round(ns / count / 1e6, 4) if count else None

    compute_ns = counters.compute_input_ns + counters.compute_infer_ns + counters.compute_output_ns
    return EngineView(counters.success + counters.fail, counters.fail, per(counters.queue_ns, counters.queue_count),
                      per(compute_ns, computed), per(counters.compute_input_ns, computed),
                      per(counters.compute_infer_ns, computed), per(counters.compute_output_ns, computed),
                      round(counters.inference_count / counters.execution_count, 2) if counters.execution_count
                      else None, counters.cache_hits, counters.cache_misses)


def without_cache_hits(latencies: Sequence[float], hit_share: float) -> list[float]:
    """A latency sample with the cache hits taken out: the fastest ``hit_share`` of its observed
    latencies (a hit skips compute, so hits are the fastest answers of a version whose misses
    compute at all). Censored latencies (negative: the client's own deadline ran out) are kept:
    a request still waiting at its client's deadline was no cache hit."""
    if hit_share <= 0:
        return list(latencies)
    observed = sorted(v for v in latencies if v > 0)
    drop = min(len(observed), round(hit_share * len(observed)))
    return [*observed[drop:], *(v for v in latencies if v <= 0)]


def median_ms(latencies: Sequence[float]) -> float | None:
    observed = sorted(v for v in latencies if v > 0)
    if not observed:
        return None
    middle = len(observed) // 2
    value = observed[middle] if len(observed) % 2 else (observed[middle - 1] + observed[middle]) / 2
    return value * 1000


def latency_cause(canary: EngineView, reference: EngineView, observed_ms: float | None, floor: float,
                  reference_ms: float | None = None) -> str | None:
    """What the canary's latency difference is put down to (module docstring): COMPUTE, QUEUE,
    OUTSIDE, or None when nothing is worse beyond ``floor`` (a ratio, the judge's latency floor;
    ``reference_ms``: the reference's median end to end, what OUTSIDE's floor applies to)."""
    queue_up = _delta(canary.queue_ms, reference.queue_ms)
    compute_up = _delta(canary.compute_ms, reference.compute_ms)
    if _worse(canary.compute_ms, reference.compute_ms, floor) and compute_up >= COMPUTE_SHARE * (
            max(queue_up, 0.0) + compute_up):
        return COMPUTE
    reference_total = (reference.queue_ms or 0.0) + (reference.compute_ms or 0.0)
    if canary.queue_ms is not None and reference.queue_ms is not None \
            and queue_up > max(MIN_SHIFT_MS, floor * reference_total):
        return QUEUE
    if observed_ms is not None:
        inside = _delta(canary.queue_ms, reference.queue_ms) + _delta(canary.compute_ms, reference.compute_ms)
        if observed_ms - inside > max(MIN_SHIFT_MS, floor * (reference_ms or 0.0)) and observed_ms > 0:
            return OUTSIDE
    return None


def _worse(canary: float | None, reference: float | None, floor: float) -> bool:
    return canary is not None and reference is not None and canary - reference > max(MIN_SHIFT_MS, floor * reference)


def _delta(canary: float | None, reference: float | None) -> float:
    return canary - reference if canary is not None and reference is not None else 0.0


@dataclass(frozen=True)
class ErrorClasses:
    """A version's failed answers over an interval, by cause: REJECTED (its queue: capacity) and
    BACKEND (the model, or any other 5xx or transport failure)."""

    rejected: int = 0
    backend: int = 0


def error_words(canary: ErrorClasses, versus: str, reference: ErrorClasses) -> str | None:
    """The canary's errors in Triton's terms, e.g. "canary errors are REJECTED (queue full or
    timed out), not BACKEND"; None when it had none."""
    if not canary.rejected and not canary.backend:
        return None
    if not canary.backend:
        return (f"canary errors are REJECTED (its queue full or timed out: capacity), not BACKEND "
                f"({canary.rejected} vs {versus} {reference.rejected})")
    if not canary.rejected:
        return (f"canary errors are BACKEND (the model failed), not REJECTED "
                f"({canary.backend} vs {versus} {reference.backend})")
    return (f"canary errors: {canary.rejected} REJECTED (capacity), {canary.backend} BACKEND (the model); {versus} "
            f"{reference.rejected} and {reference.backend}")


@dataclass(frozen=True)
class Attribution:
    """One interval's attribution of the canary against its reference (the stable or baseline)."""

    canary: EngineView | None
    reference: EngineView | None
    observed_ms: float | None  # the gateway's median difference, canary minus reference (cache hits out)
    queue_ms: float | None  # canary minus reference, per request
    compute_ms: float | None
    outside_ms: float | None  # what of observed_ms is not in Triton
    cause: str | None  # latency_cause()
    summary: str
    unreadable: tuple[str, ...] = ()  # servers whose statistics are missing from this interval, with why
    errors: str | None = None  # the canary's errors in Triton's words (error_words), said when they failed

    def document(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["unreadable"] = list(self.unreadable)
        return doc


def attribute(canary: TargetInterval, reference: TargetInterval, canary_latencies: Sequence[float],
              reference_latencies: Sequence[float], floor: float, versus: str = "stable",
              errors: str | None = None) -> Attribution:
    """The attribution of one interval: Triton's numbers of both versions, the gateway's
    latencies (cache hits already taken out), and ``errors`` (:func:`error_words`, kept apart)."""
    unreadable = (*canary.missing, *(m for m in reference.missing if m not in canary.missing))
    reference_ms = median_ms(reference_latencies)
    observed = _difference(median_ms(canary_latencies), reference_ms)
    if canary.counters is None or reference.counters is None:
        why = "; ".join(unreadable) or "no server read"
        words = [f"Triton's statistics unreadable ({why}): judged on the gateway's view only"]
        if observed is not None:
            words.insert(0, f"canary {observed:+.2f} ms median")
        return Attribution(None, None, observed, None, None, None, None, "; ".join(words), unreadable, errors)
    mine, theirs = view(canary.counters), view(reference.counters)
    queue, compute = _difference(mine.queue_ms, theirs.queue_ms), _difference(mine.compute_ms, theirs.compute_ms)
    inside = (queue or 0.0) + (compute or 0.0)
    outside = round(observed - inside, 3) if observed is not None else None
    cause = latency_cause(mine, theirs, observed, floor, reference_ms)
    return Attribution(mine, theirs, observed, queue, compute, outside, cause,
                       _summary(mine, theirs, observed, queue, compute, outside, cause, versus, unreadable),
                       unreadable, errors)


def _difference(canary: float | None, reference: float | None) -> float | None:
    return round(canary - reference, 3) if canary is not None and reference is not None else None


def _summary(mine: EngineView, theirs: EngineView, observed: float | None, queue: float | None,
             compute: float | None, outside: float | None, cause: str | None, versus: str,
             unreadable: tuple[str, ...]) -> str:
    """E.g. "canary +3.10 ms median: queue +2.90 ms, compute +0.20 ms, batch 1.0 vs 3.8 (Triton, per
    request): the queue"."""
    parts = []
    if queue is not None:
        parts.append(f"queue {queue:+.2f} ms")
    if compute is not None:
        parts.append(f"compute {compute:+.2f} ms")
    if outside is not None and abs(outside) >= max(MIN_SHIFT_MS, abs(observed or 0.0) / 4):  # a part worth naming
        parts.append(f"outside Triton {outside:+.2f} ms")
    if mine.batch is not None and theirs.batch is not None:
        parts.append(f"batch {mine.batch:.1f} vs {theirs.batch:.1f}")
    head = f"canary {observed:+.2f} ms median vs {versus}" if observed is not None else f"canary vs {versus}"
    words = [f"{head}: {', '.join(parts)}" if parts else f"{head}: no request of both in Triton this interval"]
    if cause is not None:
        words[0] += f" (the difference is in {'the ' if cause != OUTSIDE else ''}{cause})"
    if mine.cache_hits or theirs.cache_hits:
        words.append(f"cache hits (not in latency): canary {mine.hit_share:.0%} of "
                     f"{mine.cache_hits + mine.cache_misses}, {versus} {theirs.hit_share:.0%} of "
                     f"{theirs.cache_hits + theirs.cache_misses}")
    if unreadable:
        words.append(f"statistics missing from {'; '.join(unreadable)}")
    return "; ".join(words)
