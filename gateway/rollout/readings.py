"""What the rollout controller reads of a rollout's versions from telemetry: the metrics
windows it judges, the per-request samples the statistical judge takes each interval, and
the latency sampling it switches on only while a rollout needs it. Reads only: no store, no
policy, no decision."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from gateway.errors import MetricsUnavailable
from gateway.rollout.phases import Phase
from gateway.rollout.steps import Rollout
from gateway.telemetry.recorder import Recorder, Window
from gateway.telemetry.sources import MetricsSource, RecorderSource

log = logging.getLogger("gateway.rollout")
# One version's samples: latencies; streaming first responses and gaps; per-client counts (or None)
Samples = tuple[list[float], tuple[list[float], list[float]], Mapping[str, tuple[int, ...]] | None]


def take_samples(recorder: Recorder, source: MetricsSource, rollout: Rollout) -> list[Samples]:
    """The canary's and its reference's (the baseline, or the stable) per-request samples since
    the last take (latencies; streaming first responses and gaps; per-client counts, which only
    the recorder source has: Prometheus does not know clients); taking them starts the next
    interval's."""
    take_latencies, take_stream = recorder.take_latencies, recorder.take_stream
    local = isinstance(source, RecorderSource)
    return [(take_latencies(rollout.model, version), take_stream(rollout.model, version),
             recorder.take_clients(rollout.model, version) if local else None)
            for version in (rollout.canary, rollout.reference)]


def watch(recorder: Recorder, rollout: Rollout) -> None:
    """Latency samples for the statistical judge, only while a rollout needs them."""
    for version in (rollout.canary, rollout.reference):
        if rollout.phase in (Phase.PROGRESSING, Phase.PAUSED) and rollout.spec.judge == "statistical":
            recorder.watch_latencies(rollout.model, version)
        else:
            recorder.unwatch_latencies(rollout.model, version)


async def windows(source: MetricsSource, rollout: Rollout, timeout_s: float) -> tuple[Window | None, Window | None]:
    """The canary's and its reference's metrics over the last interval; (None, None) when the
    source cannot say within ``timeout_s``."""
    seconds = rollout.spec.interval_s
    try:
        async with asyncio.timeout(timeout_s):
            canary = await source.window(rollout.model, rollout.canary, seconds)
            reference = await source.window(rollout.model, rollout.reference, seconds)
    except (MetricsUnavailable, TimeoutError) as exc:
        log.warning("rollout of %s: metrics unavailable: %s", rollout.model, exc or "timed out")
        return None, None
    return canary, reference
