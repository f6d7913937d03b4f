"""`gateway ctl rollout status` shows the statistical judge's evidence in its own words."""

from __future__ import annotations

import dataclasses

from rich.console import Console

from gateway.ctl.views import rollout_view
from gateway.rollout import steps
from gateway.rollout.judge import Evidence, VersionSample, assess
from gateway.rollout.spec import RolloutSpec


def test_status_view_shows_each_metrics_verdict_and_summary() -> None:
    spec = RolloutSpec(canary="3", stable="2")
    verdict, evidence = assess(spec, Evidence(), VersionSample(12, 0, 0, 0, [0.001] * 12),
                               VersionSample(1200, 6, 0, 0, [0.001] * 1000))
    rollout = steps.on_verdict(steps.begin("qc", spec, "2", now=0), verdict, 30, evidence.document())
    doc = rollout.document()
    console = Console(record=True, width=240)
    console.print(rollout_view(doc))
    shown = " ".join(console.export_text().split())  # the caption wraps at the table's width
    for metric in verdict.metrics:
        assert metric.summary in shown
    assert "INCONCLUSIVE" in shown and "more canary requests needed" in shown


def test_status_view_of_a_thresholds_rollout_has_no_evidence_lines() -> None:
    spec = RolloutSpec(canary="3", stable="2", judge="thresholds")
    doc = dataclasses.replace(steps.begin("qc", spec, "2", now=0)).document()
    console = Console(record=True, width=240)
    console.print(rollout_view(doc))
    assert "INCONCLUSIVE" not in console.export_text()


def test_status_view_shows_webhook_failures_only_when_there_are_some() -> None:
    doc = steps.begin("qc", RolloutSpec(canary="3", stable="2", judge="thresholds"), "2", now=0).document()
    console = Console(record=True, width=240)
    console.print(rollout_view({**doc, "hooks": {"delivered": 4, "failures": 0, "last_error": None}}))
    assert "webhooks" not in console.export_text()
    failed = {"delivered": 1, "failures": 2, "last_error": "http://ops/hook: answered 502 (4 attempts)"}
    console.print(rollout_view({**doc, "hooks": failed}))
    shown = " ".join(console.export_text().split())
    assert "webhooks: 2 failed (last: http://ops/hook: answered 502 (4 attempts)), 1 delivered" in shown
