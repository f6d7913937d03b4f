"""Recorder cost: time per recorded sample and memory over 1,000,000 samples.

    .venv/bin/python bench/recorder.py
"""

from __future__ import annotations

import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.telemetry.recorder import Outcome, Recorder  # noqa: E402


def main(samples: int = 1_000_000) -> int:
    clock = [0.0]
    recorder = Recorder(clock=lambda: clock[0])
    outcomes = [Outcome.SUCCESS] * 9 + [Outcome.UPSTREAM_ERROR]
    latencies = [0.001 * (1 + i % 37) for i in range(1000)]
    versions = ["1", "2", "3"]
    tracemalloc.start()
    marks = []
    started = time.perf_counter()
    for i in range(samples):
        clock[0] = i / 1000.0  # 1,000 requests per second of simulated time: the 300 s ring fills at 300k
        recorder.record("qc", versions[i % 3], outcomes[i % 10], latencies[i % 1000], "weighted", "http", "200")
        if i % 200_000 == 0:
            marks.append(tracemalloc.get_traced_memory()[0])
    elapsed = time.perf_counter() - started
    marks.append(tracemalloc.get_traced_memory()[0])
    tracemalloc.stop()
    # A second, untraced run for the time per sample (tracemalloc slows allocation).
    recorder = Recorder(clock=lambda: clock[0])
    started = time.perf_counter()
    for i in range(samples):
        clock[0] = i / 1000.0
        recorder.record("qc", versions[i % 3], outcomes[i % 10], latencies[i % 1000], "weighted", "http", "200")
    per_sample_us = (time.perf_counter() - started) / samples * 1e6
    print(f"{samples} samples: {per_sample_us:.2f} us per record() (traced run: {elapsed:.1f}s)")
    print("traced memory at 0, 200k, 400k, 600k, 800k, 1M samples (KiB): "
          + ", ".join(f"{m / 1024:.0f}" for m in marks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
