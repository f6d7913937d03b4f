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


def per_value_ns(samples: int, window: int, reservoir: Reservoir | None) -> float:
    """Adds ``samples`` values, taking the sample every ``window`` values (one analysis
    interval of one version); ``None`` runs the same loop without the reservoir."""
    add = reservoir.add if reservoir is not None else (lambda value: None)
    take = reservoir.take if reservoir is not None else list
    started = time.perf_counter()
    for start in range(0, samples, window):
        for i in range(start, start + window):
            add(LATENCIES[i % 1000])
        take()
    return (time.perf_counter() - started) / samples * 1e9


def record_ns(samples: int) -> float:
    clock = [0.0]
    recorder = Recorder(clock=lambda: clock[0])
    started = time.perf_counter()
    for i in range(samples):
        recorder.record("qc", "1", Outcome.SUCCESS, LATENCIES[i % 1000], "weighted")
    return (time.perf_counter() - started) / samples * 1e9 - per_value_ns(samples, samples, None)


def main(samples: int = 3_000_000) -> int:
    print(f"{samples} values; ns per value, loop overhead subtracted:")
    for window in (60, 1_024, 6_000, 60_000, samples):
        empty = per_value_ns(samples, window, None)
        cost = per_value_ns(samples, window, Reservoir(1024)) - empty
        print(f"  Reservoir(1024).add, taken every {window:>9} values: {cost:6.0f} ns")
    print(f"  Recorder.record, for scale:                         {record_ns(samples):6.0f} ns")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
