"""Is a canary slower only because of its traffic share? Real Triton, real gateway, paced load.

The statistical judge compares the canary's latencies with the stable's over the same seconds.
That is fair only if a version's latency does not depend on its share. This runs the sample
model ``qc`` (versions 2 and 3 are the same code) through the gateway at a fixed rate, under
a sequence of weights, and prints per interval: both versions' medians on the gateway's clock
(the one the judge reads), the Hodges-Lehmann shift of the smaller-share version over the
other with its 95% interval, and Triton's own per-version averages (queue and compute_infer
from its statistics API) over the same interval, to tell the gateway's share of a difference
from the model's. Each phase ends with the inverse-variance pooled shift, as the judge pools it.

With ``--baseline``, version 1 (the same code again) takes as much traffic as the smaller-share
version, out of the larger one's, and the smaller one is compared with it: a rollout's
``baseline``, the comparison the judge then makes.

    .venv/bin/python bench/canary_share.py                             # 95/5, 5/95, 80/20, 50/50
    .venv/bin/python bench/canary_share.py --delay-ms 1 --phases 95:5:30 80:20:30
    .venv/bin/python bench/canary_share.py --baseline --phases 95:5:60 80:20:30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.devtools.local_triton import LocalTriton  # noqa: E402
from gateway.rollout import stats  # noqa: E402
from gateway.upstream import HttpUpstream  # noqa: E402
from tests.support import INFER_BODY, TOKEN, GatewayThread, admin_call, gateway_settings  # noqa: E402

STAGES = ("queue", "compute_infer")


def paced(url: str, rate: float, stop: threading.Event, workers: int = 8) -> None:
    """``rate`` requests per second from ``workers`` clients on fixed schedules, until ``stop``."""
    async def run() -> None:
        client = HttpUpstream(url, max_connections=workers, request_timeout_s=30)
        period, started = workers / rate, time.monotonic()

        async def worker(index: int) -> None:
            due = started + index * period / workers
            while not stop.is_set():
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                due += period
                response = await client.request(b"POST", b"/v2/models/qc/infer", [], INFER_BODY)
                await response.read()

        await asyncio.gather(*(worker(index) for index in range(workers)))
        await client.aclose()

    asyncio.run(run())


def triton_totals(url: str, version: str) -> dict[str, tuple[int, int]]:
    with urllib.request.urlopen(f"{url}/v2/models/qc/versions/{version}/stats", timeout=5) as response:
        inference = json.loads(response.read())["model_stats"][0]["inference_stats"]
    return {stage: (inference[stage]["count"], inference[stage]["ns"]) for stage in STAGES}


def mean_ms(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], stage: str) -> float:
    count = after[stage][0] - before[stage][0]
    return (after[stage][1] - before[stage][1]) / count / 1e6 if count else math.nan


def phase(gateway: GatewayThread, triton: LocalTriton, weights: dict[str, int], seconds: float,
          interval: float, baseline: bool = False) -> None:
    canary, stable = sorted(weights, key=lambda version: weights[version])
    if baseline:  # version 1 at the canary's weight, out of the stable's: compare the canary with it
        weights = {**weights, stable: weights[stable] - weights[canary], "1": weights[canary]}
        stable = "1"
    status, doc = admin_call(gateway.url, "PUT", "/admin/models/qc/policy", {"weights": weights})
    assert status < 300, doc
    recorder = gateway.app.recorder

    async def take() -> dict[str, list[float]]:
        return {version: recorder.take_latencies("qc", version) for version in weights}

    gateway.call(take())
    print(f"weights {weights}: canary {canary} ({weights[canary]}%) vs {'baseline' if baseline else 'stable'} "
          f"{stable} ({weights[stable]}%)")
    totals = {version: triton_totals(triton.http_url, version) for version in weights}
    weight = weighted = 0.0
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        time.sleep(interval)
        sample = gateway.call(take())
        now = {version: triton_totals(triton.http_url, version) for version in weights}
        c, s = sample[canary], sample[stable]
        line = f"  n {len(c):4d} vs {len(s):4d}"
        if len(c) >= 10 and len(s) >= 10:
            shift, low, high = stats.hodges_lehmann(np.log(c), np.log(s))
            w = 1 / max((high - low) / 3.92, 1e-4) ** 2
            weight, weighted = weight + w, weighted + w * shift
            line += (f" | gateway median {np.median(c) * 1e3:.3f} vs {np.median(s) * 1e3:.3f} ms, shift "
                     f"{math.expm1(shift):+.1%} ({math.expm1(low):+.1%} to {math.expm1(high):+.1%})")
        for stage in STAGES:
            line += (f" | triton {stage} {mean_ms(totals[canary], now[canary], stage):.3f} vs "
                     f"{mean_ms(totals[stable], now[stable], stage):.3f} ms")
        print(line, flush=True)
        totals = now
    if weight:
        print(f"  pooled shift {math.expm1(weighted / weight):+.1%} (95% +-{1.96 / math.sqrt(weight):.3f} in log)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rps", type=float, default=150.0)
    parser.add_argument("--interval", type=float, default=3.0, help="seconds per printed interval")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="base delay of both versions (ms)")
    parser.add_argument("--phases", nargs="+", default=["95:5:60", "5:95:60", "80:20:30", "50:50:30"],
                        help="weight of version 2 : weight of version 3 : seconds")
    parser.add_argument("--baseline", action="store_true", help="compare the smaller-share version with version 1 "
                        "at the same share instead of with the larger-share one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        faults = Path(workdir) / "faults.json"
        faults.write_text(json.dumps({"qc": {v: {"delay_ms": args.delay_ms} for v in ("1", "2", "3")}}))
        with LocalTriton.on_free_ports(faults_file=faults) as triton:
            settings = gateway_settings(triton.http_url, admin_token=TOKEN, policies={"qc": {"weights": {"2": 100}}})
            with GatewayThread(settings) as gateway:
                async def watch() -> None:
                    for version in ("1", "2", "3"):
                        gateway.app.recorder.watch_latencies("qc", version)

                gateway.call(watch())
                stop = threading.Event()
                load = threading.Thread(target=paced, args=(gateway.url, args.rps, stop), daemon=True)
                load.start()
                time.sleep(2)
                print(f"{args.rps:g} req/s, base delay {args.delay_ms:g} ms on both versions")
                try:
                    for spec in args.phases:
                        two, three, seconds = spec.split(":")
                        phase(gateway, triton, {"2": int(two), "3": int(three)}, float(seconds), args.interval,
                              args.baseline)
                finally:
                    stop.set()
                    load.join(30)


if __name__ == "__main__":
    main()
