"""How often each judge rolls back a good canary, and how fast it catches a bad one.

Simulates whole rollouts, interval by interval, on synthetic per-request samples and drives
the REAL judges (gateway/rollout/judge.py and analysis.py) and the REAL step logic
(gateway/rollout/steps.py). Per interval: Poisson(req/s x interval) requests, split by the
rollout's current weights; each answered request is a 5xx/transport error, a 4xx or a
success (Bernoulli), and a success's latency is lognormal around a sub-millisecond median.
The statistical judge sees a uniform sample of at most ``--reservoir`` latencies per version
(what the recorder's reservoir keeps); the thresholds judge sees every latency in the
recorder's histogram buckets.

The traffic comes from ``--clients`` (200) clients at equal rates, each request routed by the
policy's draw; the statistical judge gets every interval's per-client counts, as the recorder
keeps them, and counts each client up to its share (gateway/rollout/stats.py).

Scenarios (canary vs stable; the stable has 0.5% errors, 0% 4xx):
  A/A            the canary is the stable: any rollback is a false one
  errors         3% errors instead of 0.5%
  latency        every latency 30% higher
  4xx            2% client errors instead of 0%
Adversaries (issue 23; the statistical judge only), one more client sending 10% of the traffic:
  attack-canary  (a) A/A; its requests all fail and its sticky keys land them on the canary
  attack-stable  (b) 3% vs 0.5% errors; the same client, its keys aimed at the stable
  deadline-1ms   (c) A/A; its requests carry a 1 ms grpc-timeout, aimed at the canary: those slower
                 than 1 ms end as the client's own deadline (a censored latency, never an error)
  prometheus     (d) A/A; counts read from simulated Prometheus scrapes every 5 s (a random phase),
                 exactly as the source reads them (sources.exact_increase on the raw samples;
                 no per-client counts: Prometheus has none)
  everything     (e) A/A with every test the judge can run: streaming calls (both streaming
                 metrics), the shadow gate (min_shadow_agreement 0.99, 99.9% agreeing) and two
                 custom checks (canary error rate max 0.05, canary p99 latency max 3 ms)

Verdicts that say why (issue 34: Triton's queue and compute, errors by cause, cache hits, and the
adversaries that must not make attribution say something false): ``--why``, which runs
bench/judge_why.py's scenarios with the same --runs and --seed.

    .venv/bin/python bench/judge.py                       # the README tables (~25 minutes)
    .venv/bin/python bench/judge.py --why --runs 100      # attribution: queue, compute, REJECTED, cache, adversaries
    .venv/bin/python bench/judge.py --runs 50 --judge statistical --scenario errors
    .venv/bin/python bench/judge.py --judge statistical --scenario attack-canary --scenario attack-stable
"""

from __future__ import annotations

import argparse
import dataclasses
import math
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
from gateway.rollout.check_spec import Check  # noqa: E402
from gateway.rollout.checks import check_verdict, shadow_verdict  # noqa: E402
from gateway.rollout.judge import Evidence, MetricVerdict, VersionSample, assess  # noqa: E402
from gateway.rollout.phases import Phase  # noqa: E402
from gateway.rollout.spec import RolloutSpec  # noqa: E402
from gateway.telemetry.recorder import LATENCY_BOUNDS, ShadowStats, Window  # noqa: E402
from gateway.telemetry.sources import exact_increase  # noqa: E402


@dataclass(frozen=True)
class Behaviour:
    error_rate: float = 0.005
    client_error_rate: float = 0.0
    latency_factor: float = 1.0


@dataclass(frozen=True)
class Adversary:
    """One more client: ``share`` of the traffic, all of it landing on ``aim``."""

    aim: str = "canary"  # or "stable" (while the stable takes traffic; then the canary)
    share: float = 0.1
    fails: bool = True  # every request fails (5xx)
    deadline_s: float | None = None  # its own deadline: slower requests end as a censored latency


SCENARIOS: dict[str, tuple[str, Behaviour]] = {
    "A/A": ("canary = stable", Behaviour()),
    "errors": ("3% vs 0.5% errors", Behaviour(error_rate=0.03)),
    "latency": ("+30% latency", Behaviour(latency_factor=1.3)),
    "4xx": ("2% vs 0% 4xx", Behaviour(client_error_rate=0.02)),
    "attack-canary": ("(a) A/A, one client's failing 10% aimed at the canary", Behaviour()),
    "attack-stable": ("(b) 3% vs 0.5%, one client's failing 10% aimed at the stable", Behaviour(error_rate=0.03)),
    "deadline-1ms": ("(c) A/A, one client's 10% with a 1 ms deadline at the canary", Behaviour()),
    "prometheus": ("(d) A/A, counts from Prometheus scrapes (5 s)", Behaviour()),
    "everything": ("(e) A/A, 5 metrics + shadow gate + 2 checks", Behaviour()),
}
ADVERSARIES: dict[str, Adversary] = {
    "attack-canary": Adversary("canary"),
    "attack-stable": Adversary("stable"),
    "deadline-1ms": Adversary("canary", fails=False, deadline_s=0.001),
}
STATISTICAL_ONLY = ("attack-canary", "attack-stable", "deadline-1ms", "prometheus", "everything")
CHECKS = (Check(name="canary_error_rate", query="sum(rate(x[1m]))", max=0.05),
          Check(name="canary_p99_ms", query="histogram_quantile(0.99, y)", max=3.0))


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
        return VersionSample(n, errors, client_errors, 0, self.reservoir(latencies))

    def reservoir(self, latencies: npt.NDArray[np.float64]) -> list[float]:
        if len(latencies) > self.args.reservoir:  # a reservoir is a uniform sample without replacement
            latencies = self.rng.choice(latencies, self.args.reservoir, replace=False)
        return [float(v) for v in latencies]

    def clients(self, share: float, canary: Behaviour, adversary: Adversary | None,
                streams: bool = False) -> tuple[VersionSample, VersionSample]:
        """One interval from ``--clients`` clients at equal rates (and the adversary), each
        request routed by the draw: both versions' samples with their per-client counts."""
        rng, args = self.rng, self.args
        sent = rng.poisson(args.rps * args.interval / args.clients, args.clients)
        to_canary = rng.binomial(sent, share)
        sides = []
        for n, behaviour in ((to_canary, canary), (sent - to_canary, self.stable)):
            errors = rng.binomial(n, behaviour.error_rate)
            client_errors = rng.binomial(n - errors, behaviour.client_error_rate)
            table = {f"c{i}": (int(a), int(b), int(c)) for i, (a, b, c) in enumerate(zip(n, errors, client_errors))
                     if a}
            successes = int(n.sum() - errors.sum() - client_errors.sum())
            median = args.median_ms / 1000 * behaviour.latency_factor
            sides.append((table, rng.lognormal(np.log(median), args.sigma, successes), behaviour))
        if adversary is not None:
            aimed = 0 if adversary.aim == "canary" or share >= 1 else 1
            count = int(rng.poisson(adversary.share * args.rps * args.interval))
            table, latencies, behaviour = sides[aimed]
            if adversary.fails:
                table["attacker"] = (count, count, 0)
            else:
                own = rng.lognormal(np.log(args.median_ms / 1000 * behaviour.latency_factor), args.sigma, count)
                if adversary.deadline_s is not None:  # past its deadline: censored at the deadline (-d)
                    own = np.where(own > adversary.deadline_s, -adversary.deadline_s, own)
                table["attacker"] = (int((own > 0).sum()), 0, 0)  # its own deadline is no answer to count
                sides[aimed] = (table, np.concatenate([latencies, own]), behaviour)
        samples = []
        for table, latencies, behaviour in sides:
            answered = sum(c[0] for c in table.values())
            stream: tuple[list[float], list[float]] = ([], [])
            if streams:  # a fifth of the requests stream, four responses each
                first = self.rng.lognormal(np.log(0.004 * behaviour.latency_factor), args.sigma, answered // 5)
                gaps = self.rng.lognormal(np.log(0.015 * behaviour.latency_factor), args.sigma, 3 * (answered // 5))
                stream = (self.reservoir(first), self.reservoir(gaps))
            samples.append(VersionSample(answered, sum(c[1] for c in table.values()),
                                         sum(c[2] for c in table.values()), 0, self.reservoir(latencies), *stream,
                                         clients=table))
        return samples[0], samples[1]

    def window(self, version: str, n: int, behaviour: Behaviour) -> Window:
        errors, client_errors, latencies = self.answers(n, behaviour)
        # the recorder's window judges successes + upstream errors; error latencies as fast as successes
        latencies = np.concatenate([latencies, self.rng.lognormal(np.log(self.args.median_ms / 1000), 0.1, errors)])
        histogram = np.bincount(np.searchsorted(self.bounds, latencies, side="left"), minlength=len(self.bounds) + 1)
        return Window("m", version, self.args.interval, n - client_errors, errors, client_errors,
                      tuple(int(c) for c in histogram))

    def rollout(self, spec: RolloutSpec, canary: Behaviour, scenario: str) -> tuple[steps.Rollout, int, bool]:
        """One rollout to its end: (final rollout, intervals judged, rolled back below 20%)."""
        rollout = steps.begin("m", spec, "1", now=0.0)
        evidence = Evidence()
        scrapes = Scrapes(self, self.args) if scenario == "prometheus" else None
        shadow = ShadowStats()
        for interval in range(1, self.args.max_intervals + 1):
            share = float(rollout.canary_percent) / 100
            now = interval * self.args.interval
            before = rollout.canary_percent
            if spec.judge == "statistical":
                if scrapes is not None:
                    canary_sample, stable_sample = scrapes.interval(share, canary)
                else:
                    canary_sample, stable_sample = self.clients(share, canary, ADVERSARIES.get(scenario),
                                                                streams=scenario == "everything")
                extra = self.extra(spec, canary_sample, stable_sample, shadow) if scenario == "everything" else ()
                verdict, evidence = assess(spec, evidence, canary_sample, stable_sample, extra)
                rollout = steps.on_verdict(rollout, verdict, now, evidence.document())
            else:
                total = int(self.rng.poisson(self.args.rps * self.args.interval))
                n_canary = int(self.rng.binomial(total, share))
                verdict = thresholds_judge(spec, self.window("2", n_canary, canary),
                                           self.window("1", total - n_canary, self.stable))
                rollout = steps.on_verdict(rollout, verdict, now)
            if rollout.phase is not Phase.PROGRESSING:
                return rollout, interval, rollout.phase is Phase.ROLLED_BACK and before < 20
        return rollout, self.args.max_intervals, False

    def extra(self, spec: RolloutSpec, canary: VersionSample, stable: VersionSample,
              shadow: ShadowStats) -> tuple[MetricVerdict, ...]:
        """The shadow gate (5% of the stable's requests mirrored to the canary, 99.9% agreeing)
        and the two custom checks, through the real verdict functions."""
        compared = int(self.rng.binomial(stable.requests, 0.05))
        shadow.compared += compared
        shadow.agreed += int(self.rng.binomial(compared, 0.999))
        canary_rate = canary.errors / canary.requests if canary.requests else None
        observed = [v for v in canary.latencies if v > 0]
        p99_ms = float(np.quantile(observed, 0.99)) * 1000 if observed else None
        return (check_verdict(CHECKS[0], canary_rate, "no canary requests"),
                check_verdict(CHECKS[1], p99_ms, "no latencies"),
                shadow_verdict(spec, spec.canary, shadow, True))


class Scrapes:
    """Per-second traffic into cumulative counters, scraped every ``--scrape`` seconds at a random
    phase; each interval's counts are what PrometheusSource reads: exact increases of the raw
    samples since the window's start (sources.exact_increase). The latency sample stays the
    lease holder's reservoir of the same seconds."""

    def __init__(self, simulation: Simulation, args: argparse.Namespace) -> None:
        self.simulation, self.args = simulation, args
        self.second = 0
        self.phase = float(simulation.rng.uniform(0, args.scrape))
        self.totals = np.zeros((2, 3), dtype=np.int64)  # canary, stable x answered, errors, 4xx
        self.samples: list[tuple[float, npt.NDArray[np.int64]]] = [(-1.0, self.totals.copy())]

    def interval(self, share: float, canary: Behaviour) -> tuple[VersionSample, VersionSample]:
        rng, args = self.simulation.rng, self.args
        latencies: list[list[npt.NDArray[np.float64]]] = [[], []]
        start = self.second
        for _ in range(int(args.interval)):
            sent = int(rng.poisson(args.rps))
            to_canary = int(rng.binomial(sent, share))
            for side, (n, behaviour) in enumerate(((to_canary, canary), (sent - to_canary, self.simulation.stable))):
                errors = int(rng.binomial(n, behaviour.error_rate))
                client_errors = int(rng.binomial(n - errors, behaviour.client_error_rate))
                self.totals[side] += (n, errors, client_errors)
                median = args.median_ms / 1000 * behaviour.latency_factor
                latencies[side].append(rng.lognormal(np.log(median), args.sigma, n - errors - client_errors))
            self.second += 1
            at = self.phase + args.scrape * math.floor((self.second - self.phase) / args.scrape)
            if at > self.samples[-1][0] and at <= self.second:
                self.samples.append((at, self.totals.copy()))
        del self.samples[:-int(600 / args.scrape)]  # the source looks back 300 s past the window at most
        samples = []
        for side in (0, 1):
            counts = [exact_increase([(t, float(v[side][k])) for t, v in self.samples], float(start))
                      for k in range(3)]
            samples.append(VersionSample(counts[0], counts[1], counts[2], 0,
                                         self.simulation.reservoir(np.concatenate(latencies[side]))))
        return samples[0], samples[1]


def run(args: argparse.Namespace, judge: str, scenario: str, rng: np.random.Generator) -> Tally:
    spec = RolloutSpec(canary="2", stable="1", steps=[Decimal(str(s)) for s in args.steps],
                       interval_s=args.interval, judge=judge)
    if scenario == "everything":
        spec = spec.model_copy(update={"checks": list(CHECKS), "min_shadow_agreement": 0.99})
    if args.spec:
        spec = RolloutSpec.model_validate({**spec.model_dump(), **dict(_pair(kv) for kv in args.spec)})
    simulation, tally = Simulation(args, rng), Tally()
    started = last = time.monotonic()
    for index in range(args.runs):
        behaviour = SCENARIOS[scenario][1]
        if behaviour.error_rate == Behaviour.error_rate:  # the scenarios that keep the stable's error rate
            behaviour = dataclasses.replace(behaviour, error_rate=args.base_error_rate)
        rollout, intervals, early = simulation.rollout(spec, behaviour, scenario)
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
    parser.add_argument("--clients", type=int, default=200, help="clients sending the traffic (default 200)")
    parser.add_argument("--scrape", type=float, default=5, help="Prometheus scrape interval, s (default 5)")
    parser.add_argument("--max-intervals", type=int, default=300, help="give up on a rollout after this many")
    parser.add_argument("--spec", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="override rollout spec fields, e.g. inconclusive_limit=40")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    parser.add_argument("--progress-s", type=float, default=10, help="seconds between progress lines on stderr")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if "--why" in argv:
        import judge_why  # bench/ is on sys.path when this file runs as a script

        rest = [a for a in argv if a != "--why"]
        return judge_why.main(rest)
    args = parse(argv)
    rng = np.random.default_rng(args.seed)
    rows = []
    for judge in args.judge or ["statistical", "thresholds"]:
        for scenario in args.scenario or list(SCENARIOS):
            if judge == "thresholds" and scenario in STATISTICAL_ONLY:
                continue
            rows.append((judge, scenario, run(args, judge, scenario, rng)))
    print(f"{args.rps:g} req/s from {args.clients} clients, {args.interval:g} s intervals, steps "
          f"{' '.join(f'{s:g}' for s in args.steps)} %, latency median {args.median_ms:g} ms (lognormal sigma "
          f"{args.sigma:g}), seed {args.seed}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
