"""``gateway serve`` as a process a wrapper script runs: a taken port is one line naming it on
either port (the gRPC port's was a 60-line traceback, and the process then hung), and a clean
SIGTERM drain exits 0 (it died by the signal again: -15). No Triton is needed for either."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from gateway.devtools.local_triton import free_port


def serve(**env: str) -> subprocess.Popen[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    return subprocess.Popen([sys.executable, "-m", "gateway", "serve"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={
                                **clean, "GATEWAY_STORE_URL": "memory://", "GATEWAY_TRITON_URL": "http://127.0.0.1:9",
                                "GATEWAY_TRITON_GRPC_URL": "127.0.0.1:9", "GATEWAY_DRAIN_TIMEOUT_S": "5", **env})


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("setting", ["port", "grpc_port"])
def test_a_taken_port_is_one_line_naming_it(setting: str, workers: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        ports = {"port": free_port(), "grpc_port": free_port(), setting: taken}
        process = serve(GATEWAY_PORT=str(ports["port"]), GATEWAY_GRPC_PORT=str(ports["grpc_port"]),
                        GATEWAY_WORKERS=workers)
        try:
            _, err = process.communicate(timeout=60)
        finally:
            process.kill()
    assert process.returncode == 1, err
    assert err.strip().count("\n") == 0, err
    assert f"127.0.0.1:{taken} ({setting}, GATEWAY_{setting.upper()}): address already in use" in err, err


def test_a_clean_sigterm_drain_exits_0() -> None:
    port = free_port()
    process = serve(GATEWAY_PORT=str(port), GATEWAY_GRPC_PORT=str(free_port()))
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as answer:
                    assert answer.status == 200
                    break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, process.stderr
                time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, err
