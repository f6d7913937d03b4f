"""ruff and mypy --strict over the gateway, its tests and the benchmarks, as part of `make test`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_is_clean() -> None:
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "gateway", "tests", "bench"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_is_clean() -> None:
    """Can pass 30 s on a loaded machine: mypy --strict over gateway, tests and bench without a warm cache."""
    result = subprocess.run([sys.executable, "-m", "mypy", "gateway", "tests", "bench"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
