"""How often each judge rolls back a good canary, and how fast it catches a bad one.

Simulates whole rollouts, interval by interval, on synthetic per-request samples and drives
the REAL judges (gateway/rollout/judge.py and analysis.py) and the REAL step logic
(gateway/rollout/steps.py). Per interval: Poisson(req/s x interval) requests, split by the
rollout's current weights; each answered request is a 5xx/transport error, a 4xx or a
success (Bernoulli), and a success's latency is lognormal around a sub-millisecond median.
The statistical judge sees a uniform sample of at most ``--reservoir`` latencies per version
(what the recorder's reservoir keeps); the thresholds judge sees every latency in the
recorder's histogram buckets.

Scenarios (canary vs stable; the stable has 0.5% errors, 0% 4xx):
  A/A        the canary is the stable: any rollback is a false one
  errors     3% errors instead of 0.5%
  latency    every latency 30% higher
  4xx        2% client errors instead of 0%

    .venv/bin/python bench/judge.py                       # the README table (~10 minutes)
    .venv/bin/python bench/judge.py --runs 50 --judge statistical --scenario errors
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.rollout import steps  # noqa: E402
from gateway.rollout.analysis import judge as thresholds_judge  # noqa: E402
from gateway.rollout.judge import Evidence, VersionSample, assess  # noqa: E402
from gateway.rollout.phases import Phase  # noqa: E402
from gateway.rollout.spec import RolloutSpec  # noqa: E402
from gateway.telemetry.recorder import LATENCY_BOUNDS, Window  # noqa: E402


@dataclass(frozen=True)
class Behaviour:
    error_rate: float = 0.005
    client_error_rate: float = 0.0
    latency_factor: float = 1.0


SCENARIOS: dict[str, tuple[str, Behaviour]] = {
    "A/A": ("canary = stable", Behaviour()),
    "errors": ("3% vs 0.5% errors", Behaviour(error_rate=0.03)),
    "latency": ("+30% latency", Behaviour(latency_factor=1.3)),
    "4xx": ("2% vs 0% 4xx", Behaviour(client_error_rate=0.02)),
}


@dataclass
class Tally:
    runs: int = 0
    rolled_back: int = 0
    before_20: int = 0  # rolled back while the canary had less than 20%
    intervals_to_rollback: int = 0
    paused: int = 0
    promoted: int = 0
    intervals_to_promote: int = 0
    unfinished: int = 0


class Simulation:
    def __init__(self, args: argparse.Namespace, rng: np.random.Generator) -> None:
        self.args = args
        self.rng = rng
        self.bounds = np.asarray(LATENCY_BOUNDS)
        self.stable = Behaviour(error_rate=args.base_error_rate)

    def answers(self, n: int, behaviour: Behaviour) -> tuple[int, int, npt.NDArray[np.float64]]:
        """errors, client errors, latencies (seconds) of the successes."""
        errors = int(self.rng.binomial(n, behaviour.error_rate))
        client_errors = int(self.rng.binomial(n - errors, behaviour.client_error_rate))
        successes = n - errors - client_errors
        median = self.args.median_ms / 1000 * behaviour.latency_factor
        return errors, client_errors, self.rng.lognormal(np.log(median), self.args.sigma, successes)

    def sample(self, n: int, behaviour: Behaviour) -> VersionSample:
        errors, client_errors, latencies = self.answers(n, behaviour)
        if len(latencies) > self.args.reservoir:  # a reservoir is a uniform sample without replacement
            latencies = self.rng.choice(latencies, self.args.reservoir, replace=False)
        return VersionSample(n, errors, client_errors, 0, latencies.tolist())

    def window(self, version: str, n: int, behaviour: Behaviour) -> Window:
        errors, client_errors, latencies = self.answers(n, behaviour)
        # the recorder's window judges successes + upstream errors; error latencies as fast as successes
        latencies = np.concatenate([latencies, self.rng.lognormal(np.log(self.args.median_ms / 1000), 0.1, errors)])
        histogram = np.bincount(np.searchsorted(self.bounds, latencies, side="left"), minlength=len(self.bounds) + 1)
        return Window("m", version, self.args.interval, n - client_errors, errors, client_errors,
                      tuple(int(c) for c in histogram))

    def rollout(self, spec: RolloutSpec, canary: Behaviour) -> tuple[steps.Rollout, int, bool]:
        """One rollout to its end: (final rollout, intervals judged, rolled back below 20%)."""
        rollout = steps.begin("m", spec, "1", now=0.0)
        evidence = Evidence()
        for interval in range(1, self.args.max_intervals + 1):
            share = float(rollout.canary_percent) / 100
            total = int(self.rng.poisson(self.args.rps * self.args.interval))
            n_canary = int(self.rng.binomial(total, share))
            now = interval * self.args.interval
            before = rollout.canary_percent
            if spec.judge == "statistical":
                verdict, evidence = assess(spec, evidence, self.sample(n_canary, canary),
                                           self.sample(total - n_canary, self.stable))
                rollout = steps.on_verdict(rollout, verdict, now, evidence.document())
            else:
                verdict = thresholds_judge(spec, self.window("2", n_canary, canary),
                                           self.window("1", total - n_canary, self.stable))
                rollout = steps.on_verdict(rollout, verdict, now)
            if rollout.phase is not Phase.PROGRESSING:
                return rollout, interval, rollout.phase is Phase.ROLLED_BACK and before < 20
        return rollout, self.args.max_intervals, False


def run(args: argparse.Namespace, judge: str, scenario: str, rng: np.random.Generator) -> Tally:
    spec = RolloutSpec(canary="2", stable="1", steps=[Decimal(str(s)) for s in args.steps],
                       interval_s=args.interval, judge=judge)
    if args.spec:
        spec = RolloutSpec.model_validate({**spec.model_dump(), **dict(_pair(kv) for kv in args.spec)})
    simulation, tally = Simulation(args, rng), Tally()
    started = last = time.monotonic()
    for index in range(args.runs):
        behaviour = SCENARIOS[scenario][1]
        if behaviour.error_rate == Behaviour.error_rate:  # the scenarios that keep the stable's error rate
            behaviour = dataclasses.replace(behaviour, error_rate=args.base_error_rate)
        rollout, intervals, early = simulation.rollout(spec, behaviour)
        tally.runs += 1
        if rollout.phase is Phase.ROLLED_BACK:
            tally.rolled_back += 1
            tally.intervals_to_rollback += intervals
            tally.before_20 += early
        elif rollout.phase is Phase.PROMOTED:
            tally.promoted += 1
            tally.intervals_to_promote += intervals
        elif rollout.phase is Phase.PAUSED:
            tally.paused += 1
        else:
            tally.unfinished += 1
        if time.monotonic() - last > args.progress_s:
            last = time.monotonic()
            per_run = (last - started) / (index + 1)
            print(f"  {judge} {scenario}: {index + 1}/{args.runs} runs, {tally.rolled_back} rolled back, "
                  f"~{per_run * (args.runs - index - 1):.0f}s left", file=sys.stderr, flush=True)
    return tally


def _pair(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    return key, value


def _rate(count: int, runs: int) -> str:
    return f"{count / runs:.1%}" if runs else "-"


def _mean(total: int, count: int) -> str:
    return f"{total / count:.1f}" if count else "-"


def table(rows: list[tuple[str, str, Tally]]) -> str:
    head = ("| judge | canary | runs | rolled back | rolled back before 20% | intervals to roll back (mean) "
            "| promoted | intervals to promote (mean) | paused |")
    lines = [head, "|" + "---|" * 9]
    for judge, scenario, t in rows:
        lines.append(f"| {judge} | {SCENARIOS[scenario][0]} | {t.runs} | {_rate(t.rolled_back, t.runs)} | "
                     f"{_rate(t.before_20, t.runs)} | {_mean(t.intervals_to_rollback, t.rolled_back)} | "
                     f"{_rate(t.promoted, t.runs)} | {_mean(t.intervals_to_promote, t.promoted)} | "
                     f"{_rate(t.paused, t.runs)} |")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rps", type=float, default=200, help="requests per second to the model (default 200)")
    parser.add_argument("--interval", type=float, default=30, help="seconds per analysis interval (default 30)")
    parser.add_argument("--steps", type=float, nargs="+", default=[1, 5, 20, 50, 100],
                        help="canary percent per step (default 1 5 20 50 100)")
    parser.add_argument("--runs", type=int, default=1000, help="rollouts per judge and scenario (default 1000)")
    parser.add_argument("--judge", choices=["statistical", "thresholds"], action="append",
                        help="judge(s) to run (default both)")
    parser.add_argument("--scenario", choices=list(SCENARIOS), action="append", help="scenario(s) (default all)")
    parser.add_argument("--base-error-rate", type=float, default=0.005,
                        help="the stable's 5xx rate, and the canary's but in the errors scenario (default 0.005)")
    parser.add_argument("--median-ms", type=float, default=0.6, help="stable's median latency (default 0.6 ms)")
    parser.add_argument("--sigma", type=float, default=0.35, help="lognormal sigma of latencies (default 0.35)")
    parser.add_argument("--reservoir", type=int, default=1024, help="latencies kept per version per interval")
    parser.add_argument("--max-intervals", type=int, default=300, help="give up on a rollout after this many")
    parser.add_argument("--spec", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="override rollout spec fields, e.g. inconclusive_limit=40")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    parser.add_argument("--progress-s", type=float, default=10, help="seconds between progress lines on stderr")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    rng = np.random.default_rng(args.seed)
    rows = []
    for judge in args.judge or ["statistical", "thresholds"]:
        for scenario in args.scenario or list(SCENARIOS):
            rows.append((judge, scenario, run(args, judge, scenario, rng)))
    print(f"{args.rps:g} req/s, {args.interval:g} s intervals, steps {' '.join(f'{s:g}' for s in args.steps)} %, "
          f"latency median {args.median_ms:g} ms (lognormal sigma {args.sigma:g}), seed {args.seed}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
