"""A real Prometheus scrapes the gateway and Triton; the deploy/ configs pass promtool."""

from __future__ import annotations

import asyncio
import math
import subprocess
import time
from pathlib import Path

import pytest

from gateway.devtools.local_triton import LocalTriton
from gateway.telemetry.sources import PrometheusSource
from tests.conftest import Faults, PrometheusServer
from tests.support import GatewayThread, drive, gateway_settings, wait_for

pytestmark = pytest.mark.triton
DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


@pytest.mark.parametrize(("what", "path"), [("config", "prometheus.yml"), ("rules", "alerts.yml")])
def test_promtool_accepts_the_deploy_files(what: str, path: str) -> None:
    result = subprocess.run(["promtool", "check", what, str(DEPLOY / path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promql_sees_what_the_recorder_sees(triton: LocalTriton, faults: Faults, tmp_path: Path) -> None:
    faults.set("qc", "3", error_rate=0.25)
    settings = gateway_settings(triton.http_url, policies={"qc": {"weights": {"2": 70, "3": 30}}})
    with GatewayThread(settings) as gw:
        asyncio.run(drive(gw.url, 50, concurrency=2))  # create every series before Prometheus' first scrape
        prometheus = PrometheusServer(tmp_path, {"gateway": gw.hostport,
                                                 "triton": f"127.0.0.1:{triton.metrics_port}"})
        try:
            wait_for(lambda: prometheus.query('gateway_requests_total{version="3"}'), 10, what="first scrape")
            time.sleep(3.5)  # the warm-up requests fall out of the compared window
            started = time.monotonic()
            asyncio.run(drive(gw.url, 2000, concurrency=8))
            time.sleep(2.5)  # two more scrapes
            # Reach 2 s before the traffic: Prometheus needs a sample from before it to see the increase.
            seconds = math.ceil(time.monotonic() - started) + 2
            source = PrometheusSource(prometheus.url)
            promql = asyncio.run(source.window("qc", "3", seconds))
            local = gw.app.recorder.window("qc", "3", seconds)
            assert local.error_rate is not None and promql.error_rate is not None
            assert abs(promql.error_rate - local.error_rate) < 0.04, (promql, local)
            assert 0.15 < promql.error_rate < 0.35
            local_p99, prom_p99 = local.quantile(0.99), promql.quantile(0.99)
            assert local_p99 is not None and prom_p99 is not None
            assert abs(prom_p99 - local_p99) <= 0.25 * local_p99 + 0.001, (prom_p99, local_p99)
            assert prometheus.query('nv_inference_request_success{model="qc",version="2"}'), "Triton scraped too"
        finally:
            prometheus.stop()


def test_a_new_versions_first_errors_count_and_overload_is_not_an_error(triton: LocalTriton, faults: Faults,
                                                                         tmp_path: Path) -> None:
    """No warm-up: the canary's series exist at 0 from the first scrape, so the window counts
    its very first errors, exactly; Triton's queue-full 503s (rejected) and 400s are counted apart from errors."""
    faults.set("qc", "3", error_rate=0.4, client_error_rate=0.2, overload_rate=0.2)
    # all of it routed to 3 by the policy (a version in the URL would be counted, never judged)
    settings = gateway_settings(triton.http_url, policies={"qc": {"weights": {"2": 0, "3": 100}}})
    with GatewayThread(settings) as gw:
        prometheus = PrometheusServer(tmp_path, {"gateway": gw.hostport})
        try:
            wait_for(lambda: prometheus.query('gateway_version_requests_total{version="3",outcome="upstream_error"}'),
                     10, what="first scrape")
            time.sleep(1.5)  # at least two scrapes of the zeros
            started = time.monotonic()
            asyncio.run(drive(gw.url, 400, concurrency=4))
            time.sleep(2.5)
            seconds = math.ceil(time.monotonic() - started) + 2
            promql = asyncio.run(PrometheusSource(prometheus.url).window("qc", "3", seconds))
            local = gw.app.recorder.window("qc", "3", seconds)
        finally:
            prometheus.stop()
    assert local.requests + local.client_errors + local.rejected == 400
    # exact counts from the raw counter samples (no increase() extrapolation, which read ~1.2x
    # here); missing a series' first sample would be far below (all of a short burst)
    for name in ("requests", "errors", "client_errors", "rejected"):
        assert getattr(promql, name) == getattr(local, name), (name, promql, local)
    assert sum(promql.histogram) == local.requests
    assert local.rejected > 40 and local.client_errors > 40 and local.errors > 100
