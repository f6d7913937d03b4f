"""A property test's failure must print its counterexample, however large (issue 22: "a failure
prints the minimal example"). With the suite's ``filterwarnings = error``, hypothesis's warning
about a repr over 30 kB used to replace the report: `make fuzz`'s gRPC budget property lost a
counterexample of six messages (one of 16 MiB) that way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

FAILING_PROPERTY = '''
from hypothesis import given, settings, strategies as st


@settings(max_examples=2, database=None)
@given(body=st.just(b"x" * 50_000))
def test_a_large_counterexample(body):
    assert len(body) < 40_000
'''


def test_a_large_counterexample_is_printed_not_replaced_by_a_warning(tmp_path: Path) -> None:
    (tmp_path / "test_large.py").write_text(FAILING_PROPERTY)
    run = subprocess.run([sys.executable, "-m", "pytest", "-c", str(PYPROJECT), "--rootdir", str(tmp_path),
                          "-p", "no:cacheprovider", "-q", str(tmp_path / "test_large.py")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 1, run.stdout[-2000:]
    assert "assert 50000 < 40000" in run.stdout, run.stdout[-2000:]
    assert "Failing test case" in run.stdout and "HypothesisWarning" not in run.stdout, run.stdout[-2000:]
