"""Where the rollout analysis reads its windows: one small protocol, two backends.

``RecorderSource`` reads this process's recorder (one replica's share of the traffic);
``PrometheusSource`` asks a real Prometheus that scrapes every replica, so the verdict
covers all traffic. Sources never throw into the controller except as
:class:`MetricsUnavailable`, which the analysis turns into an ERROR verdict.
"""

from __future__ import annotations

import json
import math
import urllib.parse
from typing import Protocol

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
    """Prometheus' HTTP query API over the gateway's own exported series."""

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    async def _query(self, client: httpx.AsyncClient, promql: str) -> list[dict[str, object]]:
        try:
            response = await client.get(f"{self.url}/api/v1/query", params={"query": promql})
            body = response.json()
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            raise MetricsUnavailable(f"prometheus at {self.url} did not answer: {exc}") from exc
        if body.get("status") != "success":
            raise MetricsUnavailable(f"prometheus query failed: {body.get('error', body)}")
        return list(body["data"]["result"])

    async def window(self, model: str, version: str, seconds: float) -> Window:
        span = f"{max(1, int(math.ceil(seconds)))}s"
        # judged!="false" rather than ="true": a replica from before the label still counts
        labels = f'model="{_escape(model)}",version="{_escape(version)}",judged!="false"'
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            outcomes = await self._query(
                client, f"sum by (outcome) (increase(gateway_version_requests_total{{{labels}}}[{span}]))")
            buckets = await self._query(
                client, f"sum by (le) (increase(gateway_request_duration_seconds_bucket{{{labels}}}[{span}]))")
        counts = {str(r["metric"]["outcome"]): round(float(r["value"][1])) for r in outcomes}  # type: ignore[index]
        cumulative = {float(str(r["metric"]["le"])): float(r["value"][1]) for r in buckets}  # type: ignore[index]
        histogram, previous = [], 0.0
        for bound in (*LATENCY_BOUNDS, math.inf):
            total = cumulative.get(bound, previous)
            histogram.append(max(0, round(total - previous)))
            previous = total
        errors, overloads = counts.get(Outcome.UPSTREAM_ERROR.value, 0), counts.get(Outcome.OVERLOAD.value, 0)
        return Window(model, version, seconds, counts.get(Outcome.SUCCESS.value, 0) + errors, errors,
                      counts.get(Outcome.CLIENT_ERROR.value, 0), tuple(histogram), overloads)


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
