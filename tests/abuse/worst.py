"""The worst value each property-test invariant reached in this run, for `make fuzz` to print.

A property test calls `note(name, value)` after each example with what it measured (RSS growth,
bystander latency, budget left held, series count...). Only the largest value per name is kept; the
run's summary (tests/run_report.py, which gathers them from every parallel worker) prints them at
the end, so a long fuzz run says how close each invariant came to its bound, not only that none broke.
"""
from __future__ import annotations

import threading

_worst: dict[str, tuple[float, str]] = {}
_lock = threading.Lock()  # notes may come from gateway/attacker threads as well as the test thread


def note(name: str, value: float, bound: float | None = None, unit: str = "") -> None:
    """Keep `value` for `name` if it is the worst (largest) so far; `bound` is shown beside it."""
    merge(name, value, unit if bound is None else f"{unit} (bound {bound:g}{unit})")


def merge(name: str, value: float, detail: str) -> None:
    """Keep a value another test process noted (its unit and bound already in ``detail``)."""
    with _lock:
        held = _worst.get(name)
        if held is None or value > held[0]:
            _worst[name] = (value, detail)


def worst() -> dict[str, tuple[float, str]]:
    """A copy of the worst values noted so far: name -> (value, unit and bound)."""
    with _lock:
        return dict(_worst)


def summary_lines() -> list[str]:
    """One line per invariant, sorted by name, for the terminal summary."""
    return [f"{name}: {value:g}{detail}" for name, (value, detail) in sorted(worst().items())]
