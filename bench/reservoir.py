"""Reservoir cost on the hot path: time per add(), beside the recorder's record() it would join.

    .venv/bin/python bench/reservoir.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.telemetry.recorder import Outcome, Recorder  # noqa: E402
from gateway.telemetry.reservoir import Reservoir  # noqa: E402

LATENCIES = [0.0005 + 0.00001 * (i % 97) for i in range(1000)]


def per_value_ns(samples: int, window: int, reservoir: Reservoir | None) -> tuple[float, float]:
    """(ns per add, us per take) over ``samples`` values, taking the sample every ``window``
    values (one analysis interval of one version); ``None`` runs the same loop without the
    reservoir, for the loop's own cost."""
    add = reservoir.add if reservoir is not None else (lambda value: None)
    take = reservoir.take if reservoir is not None else list
    adding = taking = 0.0
    for start in range(0, samples, window):
        started = time.perf_counter()
        for i in range(start, start + window):
            add(LATENCIES[i % 1000])
        middle = time.perf_counter()
        take()
        adding, taking = adding + middle - started, taking + time.perf_counter() - middle
    return adding / samples * 1e9, taking / max(1, samples // window) * 1e6


def record_ns(samples: int) -> float:
    clock = [0.0]
    recorder = Recorder(clock=lambda: clock[0])
    started = time.perf_counter()
    for i in range(samples):
        recorder.record("qc", "1", Outcome.SUCCESS, LATENCIES[i % 1000], "weighted")
    return (time.perf_counter() - started) / samples * 1e9 - per_value_ns(samples, samples, None)[0]


def main(samples: int = 3_000_000) -> int:
    print(f"{samples} values; ns per value, loop overhead subtracted:")
    for window in (60, 1_024, 6_000, 60_000, samples):
        empty, _ = per_value_ns(samples, window, None)
        add_ns, take_us = per_value_ns(samples, window, Reservoir(1024))
        print(f"  Reservoir(1024).add, taken every {window:>9} values: {add_ns - empty:6.0f} ns "
              f"(take(), on the control plane: {take_us:5.0f} us)")
    print(f"  Recorder.record, for scale:                         {record_ns(samples):6.0f} ns")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
