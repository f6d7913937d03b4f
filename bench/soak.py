"""``make soak``: the gateway's chaos soak (issue 32, item 4).

Two Tritons as one fleet; two gateway replicas on one Redis store, the second with
``--workers 2``; ~100 req/s of clients that never retry (HTTP on new and kept-alive connections,
gRPC), spread over both replicas as a load balancer would; hostile clients throughout
(slowloris heads, oversized bodies, resets); two rollouts at once: ``qc`` 2 -> 3, healthy,
which must be promoted, and ``qc_2026_12`` 1 -> 2, whose canary answers 100 ms late (the
sample models' faults file), which must be rolled back. In turn: SIGKILL of one Triton (and
its restart), SIGSTOP then SIGCONT of the other, kill -9 of the replica holding the controller
lease (and its restart), a Redis restart, kill -9 of a worker.

It prints the failed requests in two parts, those in flight on a killed process (their
connection was to the killed replica or worker at the moment of the kill, or they were in flight
through the gateway to the killed Triton) and the others, which must be none; both rollouts'
verdicts; whether the replicas and the store agree (policies and rollout states); memory and
descriptor growth per process; and how long each fault took to recover from. The exit code is 1
when there is any other failure, a rollout decided wrong or a disagreement.

    SOAK_SECONDS=300 make soak      # or: .venv/bin/python bench/soak.py --seconds 300

Every process it starts is stopped at the end, on Ctrl-C and SIGTERM too (and dies with it on a
SIGKILL). Servers listen on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
import soak_report  # noqa: E402
from soak_clients import MODELS, Endpoint, Failure, Hostile, Traffic  # noqa: E402
from soak_fleet import (  # noqa: E402
    TOKEN,
    RedisServer,
    Replica,
    Triton,
    client_ports_held,
    http_json,
    usage,
    wait_until,
)
from soak_report import WANTED  # noqa: E402

from gateway.rollout.lease import LEASE  # noqa: E402

FINAL = {"promoted", "rolled_back", "aborted"}
MAX_BODY_BYTES = 1 << 20
STOP_S = 5.0  # how long the second Triton stays SIGSTOPped


@dataclass
class Kill:
    """A process killed: which requests were in flight on it."""

    what: str
    at: float  # just before the signal
    until: float = 0.0  # the process gone (a connection opened until then was queued on it)
    replica: str = ""  # a replica (or one of its workers): requests on connections to it
    client_ports: set[int] | None = None  # a worker: the client ports of the connections it held
    triton: bool = False  # a Triton: requests in flight through the gateway at the moment

    def holds(self, failure: Failure) -> bool:
        if failure.ended < self.at:
            return False
        if self.triton:
            return failure.started <= max(self.at, self.until)
        if failure.replica != self.replica or failure.opened > max(self.at, self.until):
            return False
        return self.client_ports is None or failure.client_port in self.client_ports


@dataclass
class Soak:
    seconds: float
    workdir: Path
    stack: ExitStack
    kills: list[Kill] = field(default_factory=list)
    recovery: dict[str, str] = field(default_factory=dict)
    crashes: list[str] = field(default_factory=list)  # processes that died without the schedule's doing
    events: list[str] = field(default_factory=list)
    samples: dict[str, dict[str, Any]] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    started: float = 0.0

    def say(self, line: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {line}", flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.started if self.started else 0.0

    # -- set-up ------------------------------------------------------------------------------
    def start(self) -> None:
        self.faults = self.workdir / "faults.json"
        self.faults.write_text("{}")
        self.redis = self.stack.enter_context(_stopping(RedisServer(self.workdir / "redis"))).start()
        print(f"redis on {self.redis.url}; starting two Tritons ...", flush=True)
        self.tritons = [self.stack.enter_context(_stopping(Triton(name, self.faults, self.workdir))).start()
                        for name in ("triton-a", "triton-b")]
        fleet = {"servers": [{"http": t.server.http_url, "grpc": t.server.grpc_url} for t in self.tritons]}
        env = {"GATEWAY_TRITON_URL": self.tritons[0].server.http_url,
               "GATEWAY_TRITON_GRPC_URL": self.tritons[0].server.grpc_url,
               "GATEWAY_FLEETS": json.dumps({"default": fleet}), "GATEWAY_STORE_URL": self.redis.url,
               "GATEWAY_ADMIN_TOKEN": TOKEN, "GATEWAY_MAX_BODY_BYTES": str(MAX_BODY_BYTES),
               "GATEWAY_CONTROLLER_TICK_S": "0.5",
               "GATEWAY_POLICIES": json.dumps({"qc": {"weights": {"2": 100}},
                                               "qc_2026_12": {"weights": {"1": 100}}})}
        print("starting replica-a (one process) and replica-b (--workers 2) on Redis ...", flush=True)
        self.replicas = [self.stack.enter_context(_stopping(Replica(name, env, self.workdir, workers)))
                         for name, workers in (("replica-a", 1), ("replica-b", 2))]
        for replica in self.replicas:
            replica.start()
        self.lease = redis.Redis.from_url(self.redis.url, decode_responses=True, socket_timeout=1)
        if wait_until(lambda: self.holder() is not None, 30) is None:
            raise RuntimeError("no replica took the controller lease")

    # -- reading the state ------------------------------------------------------------------
    def holder(self) -> Replica | None:
        try:
            name = self.lease.hget(f"gateway:fence:{LEASE}", "holder")
            live = self.lease.exists(f"gateway:fence:{LEASE}:live")
        except redis.RedisError:
            return None
        if not name or not live:
            return None
        pid = int(str(name).rsplit("-", 2)[1])
        return next((r for r in self.replicas if r.pid == pid), None)

    def admin(self, path: str, method: str = "GET", body: Any = None) -> tuple[int, Any]:
        """An admin call on the first replica that answers it."""
        answer: tuple[int, Any] = (0, "no replica answered")
        for replica in self.replicas:
            answer = http_json(replica.url + path, method, body)
            if answer[0]:
                return answer
        return answer

    def rollout_state(self, model: str) -> str:
        status, doc = self.admin(f"/admin/models/{model}/rollout")
        if status != 200 or not isinstance(doc, dict):
            return "-" if status == 404 else f"? ({status})"
        return f"{doc['state']} {doc.get('weights') or ''}"

    def in_service(self, triton: Triton, wanted: bool = True) -> bool:
        """Every replica lists ``triton`` as in service (``wanted``), or as out of it."""
        for replica in self.replicas:
            status, doc = http_json(f"{replica.url}/admin/fleets")
            if status != 200:
                return False
            server = next(s for s in doc["fleets"]["default"] if s["http"] == triton.server.http_url)
            serving = bool(server["up"] and server["in_service"] and not server["ejected"])
            if serving != wanted:
                return False
        return True

    # -- the faults --------------------------------------------------------------------------
    def measure(self, name: str, predicate: Callable[[], bool], since: float, timeout: float = 120) -> None:
        """Time from ``since`` until ``predicate`` holds, in a thread of its own."""
        def wait() -> None:
            took = wait_until(predicate, timeout)
            self.recovery[name] = f"not within {timeout:.0f} s" if took is None else \
                f"{time.monotonic() - since:.1f} s"
        threading.Thread(target=wait, daemon=True).start()

    def kill_triton(self) -> None:
        triton = self.tritons[0]
        self.kills.append(Kill(f"SIGKILL {triton.name}", time.monotonic(), triton=True))
        triton.kill()
        self.kills[-1].until = time.monotonic()
        at = self.kills[-1].at
        self.say(f"SIGKILL {triton.name}; restarting it")
        self.measure(f"SIGKILL {triton.name}: out of both replicas' service",
                     lambda: self.in_service(triton, False), at)
        triton.start()
        self.recovery[f"SIGKILL {triton.name}: restarted, READY"] = f"{time.monotonic() - at:.1f} s"
        self.measure(f"SIGKILL {triton.name}: back in both replicas' service", lambda: self.in_service(triton), at)

    def mind_tritons(self) -> None:
        """A Triton that died by itself (not by the schedule) is a finding: named, and started
        again, as its orchestrator would, so that the rest of the schedule still runs on two."""
        for triton in self.tritons:
            code = triton.server.returncode
            if code is None:
                continue
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
            self.crashes.append(f"{triton.name} died by itself at {self.elapsed():.1f} s ({how}); "
                                f"log: {triton.server.log_path}")
            self.say(f"{triton.name} DIED BY ITSELF ({how}): starting it again")
            at = time.monotonic()
            triton.server.stop()
            triton.start()
            self.recovery[f"{triton.name} died by itself at {self.elapsed():.0f} s: restarted, READY"] = \
                f"{time.monotonic() - at:.1f} s"

        for replica in self.replicas:
            if replica.process is None or replica.process.poll() is None or replica.killed:
                continue
            self.crashes.append(f"{replica.name} died by itself at {self.elapsed():.1f} s (exit "
                                f"{replica.process.returncode}); log: {self.workdir / replica.name}.log")
            self.say(f"{replica.name} DIED BY ITSELF: starting it again")
            replica.start()

    def sleep(self, seconds: float) -> None:
        """Sleep in the main thread (which starts processes), minding the Tritons meanwhile."""
        ends = time.monotonic() + seconds
        while (left := ends - time.monotonic()) > 0:
            time.sleep(min(left, 0.5))
            self.mind_tritons()

    def stop_triton(self) -> None:
        triton = self.tritons[1]
        triton.pause()
        at = time.monotonic()
        self.say(f"SIGSTOP {triton.name} (for {STOP_S:.0f} s)")
        self.measure(f"SIGSTOP {triton.name}: out of both replicas' service", lambda: self.in_service(triton, False),
                     at, STOP_S)

    def continue_triton(self) -> None:
        triton = self.tritons[1]
        triton.resume()
        self.say(f"SIGCONT {triton.name}")
        self.measure(f"SIGCONT {triton.name}: back in both replicas' service", lambda: self.in_service(triton),
                     time.monotonic())

    def start_rollouts(self, failing: bool) -> None:
        if failing:
            self.faults.write_text(json.dumps({"qc_2026_12": {"2": {"delay_ms": 100}}}))
            spec = {"canary": "2", "judge": "thresholds", "steps": [10, 25, 50, 75, 100],
                    "interval_s": max(5.0, self.seconds / 30), "min_requests": 10}
            model = "qc_2026_12"
        else:
            spec = {"canary": "3", "judge": "thresholds", "steps": [10, 25, 50, 75, 100],
                    "interval_s": max(10.0, self.seconds / 8), "min_requests": 20}
            model = "qc"
        status, doc = self.admin(f"/admin/models/{model}/rollout", "POST", spec)
        if status != 200:
            raise RuntimeError(f"the rollout of {model} was refused: {status} {doc}")
        self.say(f"rollout of {model} started: {json.dumps(spec)}"
                 + (" (canary 100 ms late: faults file)" if failing else ""))

    def kill_holder(self) -> None:
        holder = self.holder()
        if holder is None:
            self.say("no lease holder to kill")
            return
        survivor = next(r for r in self.replicas if r is not holder)
        self.kills.append(Kill(f"kill -9 {holder.name} (the lease holder)", time.monotonic(), replica=holder.name))
        holder.kill()
        self.kills[-1].until = time.monotonic()
        at = self.kills[-1].at
        self.killed_replica = holder
        self.say(f"kill -9 {holder.name}, the lease holder")
        self.measure("kill -9 of the lease holder: lease taken by the other replica",
                     lambda: self.holder() is survivor, at)

    def restart_replica(self) -> None:
        replica = self.killed_replica
        at = self.kills[-1].at
        replica.start()
        self.recovery[f"kill -9 {replica.name}: restarted and ready"] = f"{time.monotonic() - at:.1f} s"
        self.say(f"{replica.name} restarted")

    def restart_redis(self) -> None:
        at = time.monotonic()
        self.redis.stop()
        self.say("Redis stopped (SIGTERM); starting it again")
        time.sleep(1.0)
        self.redis.start()
        last = [self._lease_ttl()]  # the live key as the append-only file gave it back (-2: expired meanwhile)

        def renewed() -> bool:  # the TTL only falls between renewals: a rise is a renewal
            now = self._lease_ttl()
            risen = now > last[0] + 20 if last[0] >= 0 else now > 0
            last[0] = now
            return risen

        self.measure("Redis restart: the lease renewed in it", renewed, at)

    def _lease_ttl(self) -> int:
        try:
            return int(self.lease.pttl(f"gateway:fence:{LEASE}:live"))
        except redis.RedisError:
            return -2

    def kill_worker(self) -> None:
        replica = self.replicas[1]
        workers = [w for w in replica.worker_list() if w["up"]]
        if not workers:
            self.say("no worker up to kill")
            return
        victim = workers[0]
        held = client_ports_held(victim["pid"], {replica.port, replica.grpc_port})
        self.kills.append(Kill(f"kill -9 {replica.name} worker {victim['index']}", time.monotonic(),
                               replica=replica.name, client_ports=held))
        os.kill(victim["pid"], signal.SIGKILL)
        wait_until(lambda: usage(victim["pid"]) is None, 5, 0.01)
        self.kills[-1].until = time.monotonic()
        at = self.kills[-1].at
        self.say(f"kill -9 {replica.name} worker {victim['index']} (pid {victim['pid']}, {len(held)} client "
                 "connections)")

        def replaced() -> bool:
            slot = next(w for w in replica.worker_list() if w["index"] == victim["index"])
            return bool(slot["pid"] != victim["pid"] and slot["up"])

        self.measure("kill -9 of a worker: replacement up", replaced, at)

    # -- watching ----------------------------------------------------------------------------
    def processes(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for triton in self.tritons:
            if triton.pid:
                found[triton.name] = triton.pid
        if self.redis.pid:
            found["redis"] = self.redis.pid
        for replica in self.replicas:
            if replica.pid is None or replica.process is None or replica.process.poll() is not None:
                continue
            found[replica.name if replica.workers == 1 else f"{replica.name} control plane"] = replica.pid
            for worker in replica.worker_list() if replica.workers > 1 else []:
                if worker["pid"]:
                    found[f"{replica.name} worker {worker['index']}"] = worker["pid"]
        return found

    def sample(self) -> None:
        for role, pid in self.processes().items():
            measured = usage(pid)
            if measured is None:
                continue
            key = f"{role} (pid {pid})"
            entry = self.samples.setdefault(key, {"first": None, "since": time.monotonic()})
            if entry["first"] is None and time.monotonic() - entry["since"] >= 10:  # past its start
                entry["first"] = measured
            entry["last"], entry["at"] = measured, time.monotonic()
            entry["peak"] = max(entry.get("peak", measured), measured)

    def watch(self, traffic: Traffic) -> None:
        """Progress every 10 s and usage every 5 s, until the soak is done."""
        last_print = 0.0
        while not self.done.wait(5.0):
            self.sample()
            if time.monotonic() - last_print >= 10:
                last_print = time.monotonic()
                holder = self.holder()
                self.say(f"answered {traffic.answered:,}, failed {len(traffic.failures)} | "
                         + " | ".join(f"{m}: {self.rollout_state(m)}" for m, _ in MODELS)
                         + f" | lease: {holder.name if holder else '-'}")

    def run(self, traffic: Traffic) -> None:
        d = self.seconds
        schedule: list[tuple[float, Callable[[], None]]] = [
            (0.0, lambda: self.start_rollouts(False)),
            (0.08 * d, self.kill_triton),
            (0.20 * d, self.stop_triton),
            (0.20 * d + STOP_S, self.continue_triton),
            (0.30 * d, lambda: self.start_rollouts(True)),
            (0.36 * d, self.kill_holder),
            (0.36 * d + 2, self.restart_replica),
            (0.52 * d, self.restart_redis),
            (0.66 * d, self.kill_worker),
        ]
        for at, action in schedule:
            self.sleep(self.started + at - time.monotonic())
            action()
        self.sleep(self.started + d - time.monotonic())
        extra = max(60.0, d / 2)
        self.say(f"the schedule is done; waiting up to {extra:.0f} s for both rollouts to end")
        ends = time.monotonic() + extra
        while time.monotonic() < ends and not all(self.rollout_state(m).split()[0] in FINAL for m in WANTED):
            self.sleep(1.0)

    def report(self, traffic: Traffic, hostile: Hostile) -> int:
        return soak_report.report(self, traffic, hostile)


class _stopping:
    """``with _stopping(server)``: its stop() on the way out."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def __enter__(self) -> Any:
        return self.server

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


def _interrupted(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=float(os.environ.get("SOAK_SECONDS", "300")),
                        help="length of the fault schedule (default: $SOAK_SECONDS or 300); the rollouts get up to "
                        "half as long again to end")
    args = parser.parse_args()
    if args.seconds < 60:
        parser.error("--seconds: at least 60 (the faults need room between them)")
    signal.signal(signal.SIGTERM, _interrupted)
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    with ExitStack() as stack:
        soak = Soak(args.seconds, workdir, stack)
        try:
            soak.start()
            endpoints = [Endpoint(r.name, r.port, r.grpc_port) for r in soak.replicas]
            traffic = Traffic(endpoints).start()
            stack.callback(traffic.finish)
            hostile = Hostile(endpoints, MAX_BODY_BYTES).start()
            stack.callback(hostile.finish)
            soak.started = time.monotonic()
            watcher = threading.Thread(target=soak.watch, args=(traffic,), daemon=True)
            watcher.start()
            stack.callback(soak.done.set)
            soak.say(f"traffic and hostile clients under way; faults over {args.seconds:.0f} s")
            soak.run(traffic)
            hostile.finish()
            traffic.finish()
            soak.done.set()
            soak.sample()
            return soak.report(traffic, hostile)
        except KeyboardInterrupt:
            print("\ninterrupted: stopping every process the soak started", flush=True)
            return 130


if __name__ == "__main__":
    sys.exit(main())
