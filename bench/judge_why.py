"""Verdicts that say why (issue 34): how often a rollout ends as it should, and whether the verdict
names the right cause, with Triton's own statistics beside the gateway's view.

Simulates whole rollouts interval by interval and drives the REAL code: the gateway's latencies
and errors go to the statistical judge (gateway/rollout/judge.py) with per-client counts as the
recorder keeps them; Triton's per-version counters (queue and compute nanoseconds, inference and
execution counts, cache hits) go through the real attribution (gateway/rollout/attribution.py,
rollout/engine.with_attribution: cache hits out of the latencies, the cause, the failure class),
and the real step logic decides (rollout/steps.py). A request's gateway latency is its time in
Triton (queue + compute, lognormal) plus the network and gateway's (lognormal around 0.3 ms);
a cache hit has no compute.

Scenarios (canary vs stable; the stable: 0.2 ms queue, 0.5 ms compute, 0.5% errors):
  A/A            the canary is the stable
  queue          +1.5 ms in the queue, the same compute (fewer instances, a batcher's delay)
  compute        +0.5 ms of compute
  rejected       3% of its answers REJECTED by its queue (Triton's queue full or timed out)
  backend        3% BACKEND errors (the model failing)
  cold-cache     the response cache on: 80% hits on the stable, 10% on the canary (its cache
                 starts cold: the key includes the version); the same compute
Adversaries (A/A; one more client sending 10% of the traffic, its requests landing on the canary):
  slow-reader    reads its answers 20 ms late: the gateway's latency grows, Triton's does not
  deadline-1ms   a 1 ms grpc-timeout: past it, its own deadline (a censored latency); Triton counts
                 those CANCELED, in no mean
  own-timeout    sends Triton's `timeout` parameter at 1 us: every one of its requests REJECTED

Reported per scenario: rollouts rolled back / paused (capacity: the spec pauses on it) /
promoted, and over every unhealthy verdict the cause and class it named; "false" counts verdicts
that named the queue or compute (or REJECTED errors) where the truth was elsewhere.

    .venv/bin/python bench/judge_why.py --runs 100
    .venv/bin/python bench/judge_why.py --runs 20 --scenario queue --scenario slow-reader
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.rollout import steps  # noqa: E402
from gateway.rollout.analysis import Verdict  # noqa: E402
from gateway.rollout.attribution import (  # noqa: E402
    COMPUTE,
    OUTSIDE,
    QUEUE,
    ErrorClasses,
    attribute,
    error_words,
    view,
    without_cache_hits,
)
from gateway.rollout.engine import with_attribution  # noqa: E402
from gateway.rollout.judge import Evidence, VersionSample, assess  # noqa: E402
from gateway.rollout.phases import Phase  # noqa: E402
from gateway.rollout.spec import RolloutSpec  # noqa: E402
from gateway.services.engine_stats import EngineCounters, TargetInterval  # noqa: E402

MS = 1_000_000


@dataclass(frozen=True)
class Version:
    queue_ms: float = 0.2
    compute_ms: float = 0.5
    error_rate: float = 0.005
    rejected_rate: float = 0.0
    hit_rate: float = 0.0


@dataclass(frozen=True)
class Adversary:
    share: float = 0.1
    late_s: float = 0.0  # it reads its answers this late
    deadline_s: float | None = None
    own_timeout: bool = False  # its requests carry Triton's timeout at 1 us: all REJECTED


# scenario -> (words, canary, adversary, the cause and class a right verdict names)
SCENARIOS: dict[str, tuple[str, Version, Adversary | None, str | None, str | None]] = {
    "A/A": ("canary = stable", Version(), None, None, None),
    "queue": ("+1.5 ms queue", Version(queue_ms=1.7), None, QUEUE, "capacity"),
    "compute": ("+0.5 ms compute", Version(compute_ms=1.0), None, COMPUTE, "backend"),
    "rejected": ("3% REJECTED", Version(rejected_rate=0.03), None, None, "capacity"),
    "backend": ("3% BACKEND errors", Version(error_rate=0.03), None, None, "backend"),
    "cold-cache": ("cache hits 10% vs 80%", Version(hit_rate=0.1), None, None, None),
    "slow-reader": ("A/A, a client reading 20 ms late", Version(), Adversary(late_s=0.02), OUTSIDE, None),
    "deadline-1ms": ("A/A, a client's 1 ms deadlines", Version(), Adversary(deadline_s=0.001), None, None),
    "own-timeout": ("A/A, a client's 1 us Triton timeout", Version(), Adversary(own_timeout=True), None, None),
}
STABLE_HITS = {"cold-cache": 0.8}


class Simulation:
    def __init__(self, args: argparse.Namespace, rng: np.random.Generator) -> None:
        self.args, self.rng = args, rng

    def side(self, n_per_client: npt.NDArray[np.int64],
             version: Version) -> tuple[dict[str, tuple[int, ...]], list[float], EngineCounters]:
        """One version's interval: per-client counts, gateway latencies, Triton's counters."""
        rng = self.rng
        table: dict[str, tuple[int, ...]] = {}
        for index, n in enumerate(n_per_client):
            if n:
                rejected = int(rng.binomial(n, version.rejected_rate))
                errors = int(rng.binomial(n - rejected, version.error_rate))
                table[f"c{index}"] = (int(n), errors, 0, rejected)
        answered = sum(c[0] - c[1] - c[3] for c in table.values())
        hits = int(rng.binomial(answered, version.hit_rate))
        queue = rng.lognormal(np.log(version.queue_ms / 1000), 0.3, answered)
        compute = rng.lognormal(np.log(version.compute_ms / 1000), 0.3, answered - hits)
        outside = rng.lognormal(np.log(0.0003), 0.3, answered)
        latencies = queue + outside
        latencies[hits:] += compute
        counters = EngineCounters(success=answered, fail=sum(c[3] for c in table.values()), queue_count=answered,
                                  queue_ns=int(queue.sum() * 1e9), compute_count=answered - hits,
                                  compute_infer_ns=int(compute.sum() * 1e9), inference_count=answered - hits,
                                  execution_count=answered - hits, cache_hits=hits,
                                  cache_misses=(answered - hits) if version.hit_rate else 0)
        return table, [float(v) for v in latencies], counters

    def interval(self, share: float, canary: Version, stable: Version,
                 adversary: Adversary | None) -> tuple[VersionSample, VersionSample, TargetInterval, TargetInterval,
                                                       ErrorClasses, ErrorClasses]:
        args, rng = self.args, self.rng
        sent = rng.poisson(args.rps * args.interval / args.clients, args.clients)
        to_canary = rng.binomial(sent, share)
        c_table, c_lat, c_counters = self.side(to_canary, canary)
        s_table, s_lat, s_counters = self.side(sent - to_canary, stable)
        if adversary is not None and share > 0:
            count = int(rng.poisson(adversary.share * args.rps * args.interval))
            if adversary.own_timeout:  # REJECTED by Triton at once: Triton's fail count, no mean
                c_table["attacker"] = (count, 0, 0, count)
                c_counters = c_counters + EngineCounters(fail=count)
            else:
                _, own, own_counters = self.side(np.array([count]), canary)
                own_lat = np.asarray(own) + adversary.late_s
                if adversary.deadline_s is not None:  # past its deadline: cancelled in Triton, censored here
                    kept = own_lat <= adversary.deadline_s
                    own_counters = EngineCounters(success=int(kept.sum()), queue_count=int(kept.sum()),
                                                  queue_ns=int(own_counters.queue_ns * kept.mean()),
                                                  compute_count=int(kept.sum()),
                                                  compute_infer_ns=int(own_counters.compute_infer_ns * kept.mean()),
                                                  inference_count=int(kept.sum()), execution_count=int(kept.sum()),
                                                  fail=int((~kept).sum()))
                    own_lat = np.where(kept, own_lat, -adversary.deadline_s)
                c_table["attacker"] = (int((own_lat > 0).sum()), 0, 0, 0)
                c_lat = c_lat + [float(v) for v in own_lat]
                c_counters = c_counters + own_counters
        samples = []
        for table, latencies in ((c_table, c_lat), (s_table, s_lat)):
            answered = sum(c[0] for c in table.values())
            if len(latencies) > args.reservoir:
                latencies = [float(v) for v in rng.choice(latencies, args.reservoir, replace=False)]
            samples.append(VersionSample(answered, sum(c[1] for c in table.values()), 0, 0, latencies,
                                         clients=table, rejected=sum(c[3] for c in table.values())))
        classes = [ErrorClasses(sum(c[3] for c in t.values()), sum(c[1] for c in t.values()))
                   for t in (c_table, s_table)]
        return (samples[0], samples[1], TargetInterval(c_counters, ("s",), ()),
                TargetInterval(s_counters, ("s",), ()), classes[0], classes[1])

    def rollout(self, spec: RolloutSpec, scenario: str, tally: Counter[str]) -> steps.Rollout:
        _, canary, adversary, cause, failure = SCENARIOS[scenario]
        stable = Version(hit_rate=STABLE_HITS.get(scenario, 0.0))
        rollout, evidence = steps.begin("m", spec, "1", 0.0), Evidence()
        for index in range(1, self.args.max_intervals + 1):
            share = float(rollout.canary_percent) / 100
            c, s, c_engine, s_engine, c_errors, s_errors = self.interval(share, canary, stable, adversary)
            c_hits = view(c_engine.counters).hit_share if c_engine.counters else 0.0
            s_hits = view(s_engine.counters).hit_share if s_engine.counters else 0.0
            if not self.args.keep_cache_hits:  # what the controller does: hits out of the compared latencies
                c = VersionSample(c.requests, c.errors, 0, 0, without_cache_hits(c.latencies, c_hits),
                                  clients=c.clients, rejected=c.rejected)
                s = VersionSample(s.requests, s.errors, 0, 0, without_cache_hits(s.latencies, s_hits),
                                  clients=s.clients, rejected=s.rejected)
            seen = attribute(c_engine, s_engine, c.latencies, s.latencies, spec.max_latency_increase,
                             errors=error_words(c_errors, "stable", s_errors))
            verdict, evidence = assess(spec, evidence, c, s, cause=seen.cause)
            verdict = with_attribution(verdict, seen)
            self.count(verdict, cause, failure, tally)
            rollout = steps.on_verdict(rollout, verdict, index * spec.interval_s, evidence.document())
            if rollout.phase is not Phase.PROGRESSING:
                break
        return rollout

    @staticmethod
    def count(verdict: Verdict, cause: str | None, failure: str | None, tally: Counter[str]) -> None:
        if verdict.outcome.value != "unhealthy":
            return
        tally["unhealthy"] += 1
        named = (verdict.attribution or {}).get("cause")
        tally[f"cause {named}"] += 1
        tally[f"class {verdict.failure_class}"] += 1
        said_rejected = "canary errors are REJECTED" in verdict.reason or " REJECTED (capacity)" in verdict.reason
        wrong_cause = named in (QUEUE, COMPUTE) and named != cause
        wrong_errors = said_rejected and failure != "capacity"
        tally["false"] += int(wrong_cause or wrong_errors)
        tally["right"] += int((cause is None or named == cause)
                              and (failure is None or verdict.failure_class == failure))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100, help="rollouts per scenario (default 100)")
    parser.add_argument("--scenario", choices=list(SCENARIOS), action="append", help="scenario(s) (default all)")
    parser.add_argument("--rps", type=float, default=200, help="requests per second (default 200)")
    parser.add_argument("--interval", type=float, default=30, help="seconds per interval (default 30)")
    parser.add_argument("--clients", type=int, default=200, help="clients (default 200)")
    parser.add_argument("--reservoir", type=int, default=1024, help="latencies kept per version per interval")
    parser.add_argument("--max-intervals", type=int, default=200, help="give up on a rollout after this many")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep-cache-hits", action="store_true",
                        help="judge latencies with the cache hits in (what like for like takes out)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    spec = RolloutSpec(canary="2", stable="1", steps=[Decimal(1), Decimal(5), Decimal(20), Decimal(50), Decimal(100)],
                       interval_s=args.interval, latency_warmup_s=0, failure_classes={"capacity": "pause"})
    print(f"{args.rps:g} req/s from {args.clients} clients, {args.interval:g} s intervals, steps 1 5 20 50 100 %, "
          f"failure_classes capacity: pause, seed {args.seed}")
    print("| scenario | runs | rolled back | paused | promoted | unhealthy verdicts | named right | named falsely "
          "| causes named | classes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for scenario in args.scenario or list(SCENARIOS):
        simulation, tally, ends = Simulation(args, rng), Counter[str](), Counter[str]()
        for _ in range(args.runs):
            ends[simulation.rollout(spec, scenario, tally).phase.value] += 1
        causes = ", ".join(f"{k[6:]} {v}" for k, v in sorted(tally.items()) if k.startswith("cause "))
        classes = ", ".join(f"{k[6:]} {v}" for k, v in sorted(tally.items()) if k.startswith("class "))

        def share(count: int) -> str:
            return f"{count / args.runs:.0%}"

        print(f"| {SCENARIOS[scenario][0]} | {args.runs} | {share(ends['rolled_back'])} | {share(ends['paused'])} | "
              f"{share(ends['promoted'])} | {tally['unhealthy']} | {tally['right']} | {tally['false']} | "
              f"{causes or '-'} | {classes or '-'} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
