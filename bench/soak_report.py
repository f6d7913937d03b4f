"""The soak's summary (bench/soak.py): failures split by the kills that explain them, verdicts,
agreement of every replica with the store, recovery times, memory and descriptors per process."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from soak_clients import Failure, Hostile, Traffic
from soak_fleet import http_json, wait_until

from gateway.store.base import make_store

if TYPE_CHECKING:
    from soak import Soak

WANTED = {"qc": "promoted", "qc_2026_12": "rolled_back"}


def agreement(soak: Soak) -> tuple[bool, list[str]]:
    """Every replica's policies and rollout states beside the store's, until they agree (20 s at most)."""
    async def stored() -> dict[str, tuple[Any, Any, Any]]:
        store = make_store(soak.redis.url)
        await store.open()
        try:
            found = {}
            for model in WANTED:
                policy, rollout = await store.get_policy(model), await store.get_rollout(model)
                found[model] = (policy.spec.document()["weights"] if policy and policy.spec else None,
                                policy.revision if policy else None,
                                rollout.document["state"] if rollout else None)
            return found
        finally:
            await store.close()

    def views() -> dict[str, dict[str, tuple[Any, Any, Any]]]:
        seen = {"store": asyncio.run(stored())}
        for replica in soak.replicas:
            seen[replica.name] = {}
            for model in WANTED:
                _, policy = http_json(f"{replica.url}/admin/models/{model}/policy")
                _, rollout = http_json(f"{replica.url}/admin/models/{model}/rollout")
                seen[replica.name][model] = (policy.get("weights") if isinstance(policy, dict) else policy,
                                             policy.get("revision") if isinstance(policy, dict) else None,
                                             rollout.get("state") if isinstance(rollout, dict) else rollout)
        return seen

    last: dict[str, dict[str, tuple[Any, Any, Any]]] = {}

    def agree() -> bool:
        nonlocal last
        last = views()
        workers = http_json(f"{soak.replicas[1].url}/admin/workers")[1]
        return all(view == last["store"] for view in last.values()) and bool(workers.get("all_current"))

    agreed = wait_until(agree, 20, 1.0) is not None
    lines = [f"  {source:10} " + "; ".join(f"{m}: weights {w} rev {r}, rollout {s}"
                                           for m, (w, r, s) in view.items()) for source, view in last.items()]
    return agreed, lines

def report(soak: Soak, traffic: Traffic, hostile: Hostile) -> int:
    """The summary; the exit code: 1 on any other failure, a wrong verdict, a disagreement or a crash."""
    in_flight: Counter[str] = Counter()
    others: list[Failure] = []
    for failure in traffic.failures:
        kill = next((k for k in soak.kills if k.holds(failure)), None)
        if kill is None:
            others.append(failure)
        else:
            in_flight[kill.what] += 1
    print("\n==== soak summary ====")
    print(f"duration {soak.seconds:.0f} s of faults, {soak.elapsed():.0f} s in all; answered {traffic.answered:,} "
          f"({', '.join(f'{k} {v:,}' for k, v in sorted(traffic.ok.items()))}), "
          f"{traffic.answered / max(soak.elapsed(), 1):.0f} req/s")
    print(f"failed requests: {len(traffic.failures)}")
    print(f"  in flight on a killed process: {sum(in_flight.values())}"
          + "".join(f"\n    {what}: {n}" for what, n in in_flight.items()))
    print(f"  others: {len(others)}")
    for failure in others[:20]:
        print(f"    {failure.started - soak.started:7.2f}-{failure.ended - soak.started:.2f} s {failure.kind} "
              f"{failure.replica} {failure.model}: {failure.error}")
    verdicts = {model: soak.rollout_state(model).split()[0] for model in WANTED}
    right = all(verdicts[m] == wanted for m, wanted in WANTED.items())
    print("rollouts: " + "; ".join(f"{m} {verdicts[m]} (wanted {w})" for m, w in WANTED.items())
          + ("" if right else "  <-- WRONG"))
    for model in WANTED:
        _, doc = soak.admin(f"/admin/models/{model}/rollout")
        if isinstance(doc, dict):
            print(f"  {model}: {doc.get('reason') or doc.get('apply_reason') or ''}"[:300])
    agreed, lines = agreement(soak)
    print(f"replicas and store agree: {'yes' if agreed else 'NO'}")
    print("\n".join(lines))
    slowest = max(traffic.slow, key=lambda entry: entry[1], default=None)
    print(f"answers slower than 1 s: {len(traffic.slow)}" + ("" if slowest is None else
          f", the slowest {slowest[1]:.1f} s (sent at {slowest[0] - soak.started:.1f} s)"))
    print("recovery (from the fault):")
    for name, took in soak.recovery.items():
        print(f"  {name}: {took}")
    print("memory and descriptors per process (first sample 10 s after its start -> last; peak):")
    for key, entry in sorted(soak.samples.items()):
        if entry["first"] is None:
            continue
        (rss0, fd0), (rss1, fd1), (peak_rss, peak_fd) = entry["first"], entry["last"], entry["peak"]
        gone = "" if time.monotonic() - entry["at"] < 10 else "  (ended)"
        print(f"  {key:38} RSS {rss0:7.1f} -> {rss1:7.1f} MB ({rss1 - rss0:+6.1f}, peak {peak_rss:.0f}); "
              f"fds {fd0:4} -> {fd1:4} ({fd1 - fd0:+d}, peak {peak_fd}){gone}")
    print("hostile clients: " + ", ".join(f"{k} {v}" for k, v in sorted(hostile.seen.items())))
    restarts = [w["restarts"] for w in soak.replicas[1].worker_list()]
    print(f"{soak.replicas[1].name} worker restarts: {restarts} (the schedule killed one worker once)")
    print(f"processes that died by themselves: {len(soak.crashes)}" + "".join(f"\n  {c}" for c in soak.crashes))
    print(f"logs: {soak.workdir}")
    passed = not others and right and agreed and not soak.crashes
    print(f"soak {'PASSED' if passed else 'FAILED'}")
    return 0 if passed else 1


