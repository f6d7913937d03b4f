"""SIGHUP in one process (no workers): the config file is read again, tokens apply at once (a
removed one is refused and its console sessions end), and the log names every other change as
needing a restart. SIGHUP used to end the process (the signal's default action)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gateway.devtools.local_triton import LocalTriton, free_port
from tests.support import wait_for

pytestmark = pytest.mark.triton


def status_of(url: str, token: str | None = None, cookie: str | None = None, body: bytes | None = None,
              method: str = "GET") -> int:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if cookie:
        headers["Cookie"] = cookie
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, method=method, headers=headers),
                                    timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0  # not listening (yet)


def test_sighup_applies_tokens_in_one_process_and_names_the_rest(triton: LocalTriton, tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(json.dumps({"admin_tokens": {"alice": "alice-token-1", "bob": "bob-token-1"}}))
    port, log = free_port(), tmp_path / "gateway.log"
    env = {**os.environ, "GATEWAY_PORT": str(port), "GATEWAY_HOST": "127.0.0.1", "GATEWAY_GRPC_PORT": str(free_port()),
           "GATEWAY_TRITON_URL": triton.http_url, "GATEWAY_TRITON_GRPC_URL": triton.grpc_url,
           "GATEWAY_STORE_URL": "memory://"}
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as output:
        process = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config)], env=env,
                                   stdout=output, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: status_of(f"{url}/admin/models", "alice-token-1") == 200, 60, what="the gateway up")
        login = urllib.request.Request(f"{url}/console/login", method="POST", data=b'{"token": "bob-token-1"}',
                                       headers={"Origin": url, "Content-Type": "application/json"})
        with urllib.request.urlopen(login, timeout=10) as answer:
            cookie = answer.headers["set-cookie"].split(";")[0]
        assert status_of(f"{url}/console/api/overview", cookie=cookie) == 200

        config.write_text(json.dumps({"admin_tokens": {"alice": "alice-token-2"}, "max_body_bytes": 1 << 20,
                                      "max_buffered_body_bytes": 128 << 20}))
        process.send_signal(signal.SIGHUP)
        wait_for(lambda: status_of(f"{url}/admin/models", "alice-token-2") == 200, 30, what="the new token")
        assert process.poll() is None, "SIGHUP no longer ends the process"
        assert status_of(f"{url}/admin/models", "bob-token-1") == 401
        assert status_of(f"{url}/admin/models", "alice-token-1") == 401
        assert status_of(f"{url}/console/api/overview", cookie=cookie) == 401
    finally:
        process.terminate()
        process.wait(20)
    text = log.read_text()
    assert "SIGHUP: the tokens of alice (operator), bob (operator) are gone or replaced: 1 console session(s) " \
           "ended" in text, text[-2000:]
    assert "applied: admin_tokens; changed but in force only after a restart: max_body_bytes, " \
           "max_buffered_body_bytes" in text, text[-2000:]
