from __future__ import annotations

import os
import subprocess
import sys


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    return subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True, text=True, timeout=60,
                          env={**clean, **env})


def test_help_lists_every_command() -> None:
    result = run("--help")
    assert result.returncode == 0
    for command in ("serve", "triton", "demo", "ctl", "config-reference"):
        assert command in result.stdout


def test_a_bad_setting_stops_the_start_with_one_line_naming_the_field() -> None:
    result = run("serve", GATEWAY_POOL_SIZE="many")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "pool_size" in result.stderr


def test_a_missing_config_file_is_named() -> None:
    result = run("serve", "--config", "/nonexistent/gateway.yaml")
    assert result.returncode == 2 and "/nonexistent/gateway.yaml" in result.stderr


def test_ctl_without_a_gateway_fails_cleanly() -> None:
    result = run("ctl", "--url", "http://127.0.0.1:9", "models")
    assert result.returncode == 2 and "gateway ctl:" in result.stderr and "Traceback" not in result.stderr
