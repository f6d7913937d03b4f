"""Not collected by the suite (no ``test_`` prefix): tests/integration/test_interrupted_run.py runs
this file in a pytest of its own, waits until each test below holds its servers, and interrupts
that run. Each test writes a file in $HELD_DIR once its servers are up, then waits to be stopped."""

from __future__ import annotations

import os
import time
from pathlib import Path

from gateway.devtools.local_triton import LocalTriton
from tests.conftest import PrometheusServer
from tests.support import GatewayProcess


def hold(name: str) -> None:
    (Path(os.environ["HELD_DIR"]) / name).write_text(str(os.getpid()))
    time.sleep(600)  # until the run is interrupted


def test_triton_redis_and_a_gateway_process(triton: LocalTriton, redis_url: str) -> None:
    gateway = GatewayProcess({"GATEWAY_TRITON_URL": triton.http_url, "GATEWAY_STORE_URL": redis_url}).start()
    try:
        hold("gateway")
    finally:
        gateway.stop()


def test_triton_and_prometheus(triton: LocalTriton, tmp_path: Path) -> None:
    prometheus = PrometheusServer(tmp_path, {"triton": triton.metrics_url.removeprefix("http://").split("/")[0]})
    try:
        hold("prometheus")
    finally:
        prometheus.stop()
