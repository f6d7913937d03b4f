"""A worker the control plane reports up is serving: both its ports accept connections at once.

"Up" (``GET /admin/workers``, ``gateway_worker_up``) is what people, tests and a rolling SIGHUP
go by; it used to be the worker's hello, sent before its listeners listened. The test reads
the control plane on its own Unix socket (the supervisor's run directory, under the
``TMPDIR`` the test gives it), so it sees the first worker come up without going through a
worker, and connects to both ports the moment it does. Before the first worker listens the
ports are bound but not listening: a connection is refused.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.devtools.local_triton import LocalTriton, dies_with_parent
from tests.integration.test_workers import workers_env
from tests.support import TOKEN, GatewayProcess, wait_for

pytestmark = pytest.mark.triton


def test_the_first_worker_reported_up_accepts_connections_on_both_ports(triton: LocalTriton,
                                                                        tmp_path: Path) -> None:
    # a short directory: a Unix socket's path may not pass 107 bytes
    """Can pass 30 s on a loaded machine: a supervisor and its worker processes start."""
    with tempfile.TemporaryDirectory(prefix="gw-up-") as run_root:
        gw = GatewayProcess({**workers_env(triton, tmp_path, 2), "TMPDIR": run_root})
        gw.process = subprocess.Popen([sys.executable, "-m", "gateway", "serve"], env=gw.env,
                                      preexec_fn=dies_with_parent())
        try:
            control = wait_for(lambda: next(Path(run_root).glob("gateway-workers-*/control.sock"), None), 90,
                               interval=0.01, what="the control plane's socket")
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(control)), base_url="http://control",
                              headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10) as client:

                def first_up() -> list[dict[str, Any]]:
                    if gw.process.poll() is not None:
                        raise RuntimeError(f"gateway exited with {gw.process.returncode}")
                    try:
                        answer = client.get("/admin/workers")
                    except httpx.TransportError:
                        return []  # the control plane's server is not accepting yet
                    return [w for w in answer.json()["workers"] if w["up"]]

                up = wait_for(first_up, 90, interval=0.002, what="a worker up")
                refused = []
                for port in (gw.port, gw.grpc_port):  # at once, before anything else
                    try:
                        socket.create_connection(("127.0.0.1", port), 10).close()
                    except ConnectionRefusedError:
                        refused.append(port)
                assert not refused, (f"worker {up[0]['index']} was reported up while port(s) {refused} "
                                     f"(HTTP {gw.port}, gRPC {gw.grpc_port}) refused connections")
            with urllib.request.urlopen(f"{gw.url}/v2/health/live", timeout=10) as response:
                assert response.status == 200
        finally:
            gw.stop()
