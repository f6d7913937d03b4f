"""``gateway ctl`` as a pipeline uses it, against a real gateway and Triton (issue 33 item 4).

``rollout status --watch`` exits 0 promoted, 1 rolled back or aborted, 2 at ``--timeout``, 3 on
an error, and says what a pause waits for; ``versions load|unload``; a refusal names the CLI's
flag, not the JSON field, when the CLI sent it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.conftest import Faults
from tests.support import TOKEN, BackgroundLoad, GatewayThread, admin_call, rollout_gateway, rollout_status

pytestmark = pytest.mark.triton


@pytest.fixture
def gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    with rollout_gateway(triton.http_url) as running:
        yield running


def ctl_command(gateway: GatewayThread, *args: str) -> list[str]:
    return [sys.executable, "-m", "gateway", "ctl", "--url", gateway.url, "--token", TOKEN, *args]


def ctl(gateway: GatewayThread, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(ctl_command(gateway, *args), capture_output=True, text=True, timeout=60)


def watching(gateway: GatewayThread, *extra: str) -> subprocess.Popen[str]:
    """`rollout status qc --watch` in the background, once it has printed its first line."""
    process = subprocess.Popen(ctl_command(gateway, "rollout", "status", "qc", "--watch", *extra),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    first = process.stdout.readline()
    assert first.startswith(("qc: progressing", "qc: paused")), first
    return process


def ended(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=60)
    return process.returncode, out, err


def start(gateway: GatewayThread, **spec: Any) -> None:
    status, doc = admin_call(gateway.url, "POST", "/admin/models/qc/rollout", {"canary": "3", **spec})
    assert status == 200, doc


def test_watch_exits_0_when_the_rollout_is_promoted(gateway: GatewayThread) -> None:
    start(gateway, steps=[50, 100], interval_s=600)
    process = watching(gateway, "--timeout", "60")
    for _ in range(2):
        assert admin_call(gateway.url, "POST", "/admin/models/qc/rollout/promote")[0] == 200
    code, out, err = ended(process)
    assert code == 0 and "qc: promoted" in out, (out, err)


def test_watch_exits_1_when_the_rollout_is_aborted(gateway: GatewayThread) -> None:
    """(On the old code: exit 0 after an abort or a rollback.)"""
    start(gateway, interval_s=600)
    process = watching(gateway)
    assert admin_call(gateway.url, "POST", "/admin/models/qc/rollout/abort")[0] == 200
    code, out, err = ended(process)
    assert code == 1 and "qc: aborted" in err, (out, err)


def test_watch_exits_1_when_the_judge_rolls_the_canary_back_and_the_retry_names_its_flag(
        gateway: GatewayThread, faults: Faults) -> None:
    """And the 409 that follows, for a new start of the same canary, names `--retry` (it said
    `"retry": true`, the JSON field, to a CLI user)."""
    with BackgroundLoad(gateway.url, concurrency=2):
        # paused until the watch is on (a CLI's start can take longer than the first verdict), then broken:
        # critical_error_rate (0.5) rolls it back at its first verdict
        start(gateway, steps=[20, 100], interval_s=1)
        assert admin_call(gateway.url, "POST", "/admin/models/qc/rollout/pause")[0] == 200
        process = watching(gateway, "--timeout", "50")
        faults.set("qc", "3", error_rate=1.0)
        assert admin_call(gateway.url, "POST", "/admin/models/qc/rollout/resume")[0] == 200
        code, out, err = ended(process)
    assert code == 1 and "qc: rolled_back" in err, (out, err)
    again = ctl(gateway, "rollout", "start", "qc", "--canary", "3")
    assert again.returncode == 1 and "HTTP 409" in again.stderr, again
    assert "--retry" in again.stderr and '"retry"' not in again.stderr, again.stderr


def test_watch_exits_2_at_its_timeout_and_says_what_a_pause_waits_for(gateway: GatewayThread) -> None:
    """(On the old code: no --timeout, and a paused rollout was watched for ever.)"""
    start(gateway, interval_s=600)
    assert admin_call(gateway.url, "POST", "/admin/models/qc/rollout/pause")[0] == 200
    began = time.monotonic()
    result = ctl(gateway, "rollout", "status", "qc", "--watch", "--timeout", "1.5")
    assert result.returncode == 2, result
    assert 1.5 <= time.monotonic() - began < 30
    assert "--timeout 1.5 s passed" in result.stderr and "still paused" in result.stderr, result.stderr
    assert "gateway ctl rollout resume qc" in result.stdout + result.stderr, "what the pause waits for"
    assert rollout_status(gateway.url)["state"] == "paused", "watching changed nothing"


def test_watch_exits_3_on_an_error(gateway: GatewayThread) -> None:
    unknown = ctl(gateway, "rollout", "status", "no-such-model", "--watch")
    assert unknown.returncode == 3 and "HTTP 404" in unknown.stderr, unknown
    unreachable = subprocess.run([sys.executable, "-m", "gateway", "ctl", "--url", "http://127.0.0.1:9", "rollout",
                                  "status", "qc", "--watch"], capture_output=True, text=True, timeout=60)
    assert unreachable.returncode == 3 and "Traceback" not in unreachable.stderr, unreachable
    usage = ctl(gateway, "rollout", "status", "qc", "--watch", "--timeout", "soon")
    assert usage.returncode == 3 and "invalid float value" in usage.stderr, usage


def test_a_422_names_the_flag_the_cli_sent(gateway: GatewayThread) -> None:
    """A 422 named `interval_s`, a field the CLI user never typed."""
    bad = ctl(gateway, "rollout", "start", "qc", "--canary", "3", "--interval", "0.5")
    assert bad.returncode == 1 and "HTTP 422" in bad.stderr, bad.stderr
    assert "--interval: " in bad.stderr and "interval_s" not in bad.stderr, bad.stderr


def ready(gateway: GatewayThread) -> set[str]:
    models = admin_call(gateway.url, "GET", "/admin/models")[1]["models"]
    return {v["version"] for m in models if m["name"] == "qc" for v in m["versions"] if v["state"] == "READY"}


def test_versions_load_and_unload(gateway: GatewayThread) -> None:
    """qc's version 1 takes no traffic here (the policy is 2: 100); version 4 is the sample
    repository's broken one; version 2 has the policy's weight."""
    unloaded = ctl(gateway, "versions", "unload", "qc", "1")
    try:
        assert unloaded.returncode == 0 and "version 1 of qc unloaded" in unloaded.stdout, unloaded
        assert "1" not in ready(gateway)
    finally:
        loaded = ctl(gateway, "versions", "load", "qc", "1")
    assert loaded.returncode == 0 and "version 1 of qc loaded" in loaded.stdout, loaded
    assert "1" in ready(gateway)
    broken = ctl(gateway, "versions", "load", "qc", "4")
    assert broken.returncode == 1 and "HTTP" in broken.stderr, broken
    in_use = ctl(gateway, "versions", "unload", "qc", "2")
    assert in_use.returncode == 1 and "HTTP 409" in in_use.stderr, in_use
    assert ready(gateway) >= {"1", "2", "3"}
