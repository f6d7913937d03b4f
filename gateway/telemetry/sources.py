"""Where the rollout analysis reads its windows: one small protocol, two backends.

``RecorderSource`` reads a recorder (the lease holder's: the sum of every replica's published
windows, gateway.services.replica_windows);
``PrometheusSource`` asks a real Prometheus that scrapes every replica, so the verdict
covers all traffic. Sources never throw into the controller except as
:class:`MetricsUnavailable`, which the analysis turns into an ERROR verdict.
"""

from __future__ import annotations

import json
import math
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import httpx

from gateway.errors import MetricsUnavailable
from gateway.telemetry.recorder import LATENCY_BOUNDS, Outcome, Recorder, Window


class MetricsSource(Protocol):
    async def window(self, model: str, version: str, seconds: float) -> Window:
        """Requests, upstream errors and latency histogram of (model, version) over the last
        ``seconds``. Raises MetricsUnavailable when it cannot tell; zero requests is data."""


class RecorderSource:
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    async def window(self, model: str, version: str, seconds: float) -> Window:
        return self.recorder.window(model, version, seconds)


class PrometheusSource:
    """Prometheus' HTTP query API over the gateway's own exported series, read as exact counts.

    Not ``increase()``: it extrapolates to the window's edges and returns fractions, which an
    exact test on counts would read as more evidence than there is (~1.2x at a 30 s window and
    5 s scrapes, 2x at 10 s). Instead each series' raw samples are read (a range selector,
    which returns the scraped values untouched) and counted exactly: the counter's value at the
    last scrape at or before the window's start is the base, and every later rise is added up,
    a drop being a reset (a replica restarted: its new value counts from 0). A series first
    scraped inside the window counts from 0. So a window counts the requests between two
    scrapes, each exactly once across consecutive windows; it lags its nominal edges by at most
    one scrape interval."""

    LOOKBACK_S = 300  # how far before the window a base sample is looked for (Prometheus' staleness)

    def __init__(self, url: str, timeout_s: float = 5.0, clock: Callable[[], float] = time.time) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.clock = clock

    async def _query(self, client: httpx.AsyncClient, promql: str, at: float) -> list[dict[str, Any]]:
        try:
            response = await client.get(f"{self.url}/api/v1/query", params={"query": promql, "time": f"{at:.3f}"})
            body = response.json()
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            raise MetricsUnavailable(f"prometheus at {self.url} did not answer: {exc}") from exc
        if body.get("status") != "success":
            raise MetricsUnavailable(f"prometheus query failed: {body.get('error', body)}")
        return list(body["data"]["result"])

    async def window(self, model: str, version: str, seconds: float) -> Window:
        end = self.clock()
        start = end - seconds
        span = f"{int(math.ceil(seconds)) + self.LOOKBACK_S}s"
        # judged!="false" rather than ="true": a replica from before the label still counts
        labels = f'model="{_escape(model)}",version="{_escape(version)}",judged!="false"'
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            outcomes = await self._query(client, f"gateway_version_requests_total{{{labels}}}[{span}]", end)
            buckets = await self._query(client, f"gateway_request_duration_seconds_bucket{{{labels}}}[{span}]", end)
        try:
            counts = _summed(outcomes, "outcome", start)
            cumulative = {float(le): total for le, total in _summed(buckets, "le", start).items()}
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise MetricsUnavailable(f"prometheus answered an unreadable range result: {exc!r}") from exc
        histogram, previous = [], 0
        for bound in (*LATENCY_BOUNDS, math.inf):
            total = cumulative.get(bound, previous)
            histogram.append(max(0, total - previous))
            previous = total
        errors, overloads = counts.get(Outcome.UPSTREAM_ERROR.value, 0), counts.get(Outcome.OVERLOAD.value, 0)
        return Window(model, version, seconds, counts.get(Outcome.SUCCESS.value, 0) + errors, errors,
                      counts.get(Outcome.CLIENT_ERROR.value, 0), tuple(histogram), overloads,
                      counts.get(Outcome.REJECTED.value, 0))


def exact_increase(samples: Sequence[tuple[float, float]], start: float) -> int:
    """How much a counter rose after ``start``, from its raw (timestamp, value) samples in time
    order: from the last sample at or before ``start`` (or from 0 when the series was first
    scraped after it), every rise added, a drop read as a reset to 0 (the new value counts)."""
    base = None
    rise = 0.0
    for at, value in samples:
        if at <= start:
            base = value
            continue
        if base is None:
            base = 0.0
        rise += value - base if value >= base else value
        base = value
    return round(rise)


def _summed(result: list[dict[str, Any]], label: str, start: float) -> dict[str, int]:
    """Exact increases of every series in a range-query result, summed by ``label``."""
    totals: dict[str, int] = {}
    for series in result:
        key = str(series["metric"].get(label, ""))
        samples = [(float(at), float(value)) for at, value in series["values"]]
        totals[key] = totals.get(key, 0) + exact_increase(samples, start)
    return totals


def _escape(value: str) -> str:
    return urllib.parse.quote(value, safe="") if '"' in value or "\\" in value else value


def make_source(kind: str, prometheus_url: str | None, recorder: Recorder, timeout_s: float = 5.0) -> MetricsSource:
    """``recorder`` (this replica's traffic) or ``prometheus`` (every replica's, via its query API)."""
    if kind == "prometheus":
        if not prometheus_url:
            raise ValueError("metrics source 'prometheus' needs a prometheus_url")
        return PrometheusSource(prometheus_url, timeout_s)
    if kind != "recorder":
        raise ValueError(f"unknown metrics source {kind!r}: use 'recorder' or 'prometheus'")
    return RecorderSource(recorder)
