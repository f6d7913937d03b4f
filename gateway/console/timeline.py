"""Each rollout's history for the console's charts, kept (bounded) on the control plane.

The rollout record keeps only its last few verdicts and the judge's evidence so far; the charts
need every interval. A small loop reads the stored rollouts once a second and, for each verdict
it has not seen, keeps: the verdict itself (the judge's own document: per-metric effect,
interval, e-value), the interval's 4xx counts (the difference of the judge's accumulated
counts, or the thresholds judge's own rates), and the latency quantiles of both versions over
the interval (the metrics source: this replica's recorder, or Prometheus). The weights are
kept each time they change. A new rollout of a model starts its history again.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from gateway.background import Background
from gateway.errors import GatewayError
from gateway.store.base import StateStore
from gateway.telemetry.recorder import Window
from gateway.telemetry.sources import MetricsSource

log = logging.getLogger("gateway.console")
KEEP_INTERVALS = 240  # per rollout: the last 240 intervals (2 h at 30 s intervals)
KEEP_WEIGHTS = 240
MAX_MODELS = 32  # rollouts with a history at once; the least recently started goes first
QUANTILES = (("p50_ms", 0.5), ("p90_ms", 0.9), ("p99_ms", 0.99))


@dataclass
class History:
    started_at: float
    intervals: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=KEEP_INTERVALS))
    weights: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=KEEP_WEIGHTS))
    last_verdict_at: float = 0.0
    client_totals: tuple[int, int, int, int] | None = None  # the judge's accumulated 4xx counts last seen

    def document(self) -> dict[str, Any]:
        return {"started_at": self.started_at, "intervals": list(self.intervals), "weights": list(self.weights)}


def _version(window: Window | None) -> dict[str, Any] | None:
    if window is None:
        return None
    doc: dict[str, Any] = {"requests": window.requests, "errors": window.errors,
                           "client_errors": window.client_errors}
    for name, q in QUANTILES:
        value = window.quantile(q)
        doc[name] = None if value is None else round(value * 1000, 3)
    return doc


def _client_totals(doc: dict[str, Any]) -> tuple[int, int, int, int] | None:
    """The statistical judge's accumulated 4xx counts: canary n, canary 4xx, reference n, reference 4xx."""
    counts = (doc.get("evidence") or {}).get("client_errors")
    if not isinstance(counts, dict):
        return None
    try:
        return (int(counts["canary_n"]), int(counts["canary_events"]), int(counts["stable_n"]),
                int(counts["stable_events"]))
    except (KeyError, TypeError, ValueError):
        return None


class Timeline:
    def __init__(self, store: StateStore, source: MetricsSource, period_s: float = 1.0) -> None:
        self.store = store
        self.source = source
        self.period_s = period_s
        self._models: OrderedDict[str, History] = OrderedDict()
        self._background = Background()

    def history(self, model: str) -> dict[str, Any] | None:
        kept = self._models.get(model)
        return None if kept is None else kept.document()

    def start(self) -> None:
        self._background.supervise("console-timeline", self._run)

    async def stop(self) -> None:
        await self._background.cancel_all()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                await self.sample()
            except GatewayError as exc:  # the store down: the next look catches up
                log.debug("console timeline: %s", exc)

    async def sample(self) -> None:
        for model, stored in (await self.store.list_rollouts()).items():
            await self.observe(model, stored.document)

    async def observe(self, model: str, doc: dict[str, Any]) -> None:
        kept = self._models.get(model)
        if kept is None or kept.started_at != doc.get("started_at"):
            kept = self._models[model] = History(float(doc.get("started_at", 0.0)))
            while len(self._models) > MAX_MODELS:
                self._models.popitem(last=False)
        self._keep_weights(kept, doc)
        new = [v for v in doc.get("verdicts", []) if float(v.get("at", 0)) > kept.last_verdict_at]
        if not new:
            return
        canary, reference = await self._windows(model, doc)
        totals = _client_totals(doc)
        # a difference of accumulated counts is one interval's only from the rollout's first verdict on
        before = kept.client_totals if kept.client_totals is not None or len(doc["verdicts"]) > 1 else (0, 0, 0, 0)
        for verdict in new:
            interval = {"at": verdict["at"], "step": verdict.get("step"), "verdict": verdict,
                        "canary": None, "reference": None, "client": None}
            if verdict is new[-1]:  # the windows and the judge's totals are those of the newest interval only
                interval.update(canary=canary, reference=reference,
                                client=self._client_interval(before, totals, verdict))
            kept.intervals.append(interval)
        kept.last_verdict_at = float(new[-1]["at"])
        kept.client_totals = totals

    @staticmethod
    def _client_interval(before: tuple[int, int, int, int] | None, after: tuple[int, int, int, int] | None,
                         verdict: dict[str, Any]) -> dict[str, Any] | None:
        if after is not None and before is not None:
            b = before
            if all(x >= y for x, y in zip(after, b)):
                return {"canary_n": after[0] - b[0], "canary_4xx": after[1] - b[1],
                        "reference_n": after[2] - b[2], "reference_4xx": after[3] - b[3]}
        if verdict.get("canary_client_error_rate") is not None:  # the thresholds judge's own rates
            return {"canary_rate": verdict.get("canary_client_error_rate"),
                    "reference_rate": verdict.get("stable_client_error_rate")}
        return None

    async def _windows(self, model: str, doc: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        seconds = float(doc.get("spec", {}).get("interval_s", 30.0))
        reference = doc.get("baseline") or doc.get("stable")
        out: list[dict[str, Any] | None] = []
        for version in (doc.get("canary"), reference):
            try:
                window = await asyncio.wait_for(self.source.window(model, str(version), seconds), 2.0)
            except (GatewayError, TimeoutError):
                window = None
            out.append(_version(window))
        return out[0], out[1]

    @staticmethod
    def _keep_weights(kept: History, doc: dict[str, Any]) -> None:
        weights, at = doc.get("weights") or {}, float(doc.get("last_transition_at") or doc.get("started_at") or 0)
        if not kept.weights or kept.weights[-1]["weights"] != weights:
            kept.weights.append({"at": at, "weights": dict(weights), "state": doc.get("state")})
