"""Gateway overhead against direct-to-Triton, measured in one run.

Starts a local Triton (sample repository) and the gateway (policy qc: 2=80, 3=20), then for
each body kind (JSON, binary tensors) and concurrency (1, 32) drives the same load with wrk
for the same fixed time, first straight to Triton and then through the gateway (wrk cannot
stop after a request count: its threads' stop() still waits out the duration). Prints throughput,
p50/p99 latency, the gateway's CPU time per request (from /proc, the gateway process only)
and the ratios gateway/direct.

    make bench                       # or: .venv/bin/python bench/overhead.py --seconds 10
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import nginx  # noqa: E402

from gateway.devtools.local_triton import LocalTriton, free_port  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
POLICY = 'policies:\n  qc: {weights: {"2": 80, "3": 20}}\n'

LUA = r"""
wrk.method = "POST"
wrk.body = io.open(os.getenv("BENCH_BODY"), "rb"):read("*a")
local ihcl = os.getenv("BENCH_IHCL")
if ihcl ~= "" then wrk.headers["Inference-Header-Content-Length"] = ihcl end
wrk.headers["Content-Type"] = nil
response = function(status, headers, body)
  if status ~= 200 then io.stderr:write("status " .. status .. "\n") end
end
done = function(summary, latency, requests)
  io.write(string.format('{"requests": %d, "seconds": %f, "p50_us": %d, "p99_us": %d, "errors": %d}\n',
    summary.requests, summary.duration / 1e6, latency:percentile(50), latency:percentile(99),
    summary.errors.status + summary.errors.connect + summary.errors.read + summary.errors.write
    + summary.errors.timeout))
end
"""


def bodies(workdir: Path) -> dict[str, tuple[Path, str]]:
    data = [1.0, 2.0, 3.0, 4.0]
    as_json = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": data}]})
    header = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4],
                                     "parameters": {"binary_data_size": 16}}],
                         "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}).encode()
    import struct
    binary = header + struct.pack("<4f", *data)
    (workdir / "json.body").write_text(as_json)
    (workdir / "binary.body").write_bytes(binary)
    return {"json": (workdir / "json.body", ""), "binary": (workdir / "binary.body", str(len(header)))}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@dataclass
class Result:
    rps: float
    p50_us: int
    p99_us: int
    cpu_us: float | None
    errors: int
    user_us: float = 0.0  # of cpu_us, in user space (set by bench/ab.py)


def run_wrk(url: str, body: Path, ihcl: str, concurrency: int, seconds: float, script: Path,
            pid: int | None) -> Result:
    threads = 1 if concurrency == 1 else 2
    env = dict(os.environ, BENCH_BODY=str(body), BENCH_IHCL=ihcl)
    before = cpu_seconds(pid) if pid else 0.0
    out = subprocess.run(["wrk", "-t", str(threads), "-c", str(concurrency), "-d", f"{seconds:g}s", "--timeout", "10s",
                          "-s", str(script), url], env=env, capture_output=True, text=True, check=True)
    after = cpu_seconds(pid) if pid else 0.0
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    cpu = (after - before) / stats["requests"] * 1e6 if pid else None
    return Result(stats["requests"] / stats["seconds"], stats["p50_us"], stats["p99_us"], cpu, stats["errors"])


def grpc_body(workdir: Path) -> Path:
    """One gRPC frame: flag byte, big-endian length, ModelInferRequest (qc, unversioned)."""
    import struct

    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name="qc")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(struct.pack("<4f", 1, 2, 3, 4))
    raw = request.SerializeToString()
    path = workdir / "grpc.body"
    path.write_bytes(b"\x00" + struct.pack(">I", len(raw)) + raw)
    return path


def run_h2load(hostport: str, body: Path, concurrency: int, requests: int, workdir: Path,
               pid: int | None) -> Result:
    """gRPC load with h2load (nghttp2, C): a fixed request count, per-request log for percentiles."""
    log = workdir / "h2load.log"
    clients, streams = (1, 1) if concurrency == 1 else (8, concurrency // 8)
    before = cpu_seconds(pid) if pid else 0.0
    out = subprocess.run(["h2load", "-n", str(requests), "-c", str(clients), "-m", str(streams), "-t", "1",
                          "-d", str(body), "-H", "content-type: application/grpc", "-H", "te: trailers",
                          "--log-file", str(log), f"http://{hostport}/inference.GRPCInferenceService/ModelInfer"],
                         capture_output=True, text=True, check=True)
    after = cpu_seconds(pid) if pid else 0.0
    finished = next(line for line in out.stdout.splitlines() if line.startswith("finished in"))
    rps = float(finished.split(",")[1].split()[0])
    durations = sorted(int(line.split()[2]) for line in log.read_text().splitlines() if line.strip())
    failed = next(line for line in out.stdout.splitlines() if line.startswith("requests:"))
    errors = int(failed.split(",")[4].split()[0])
    cpu = (after - before) / requests * 1e6 if pid else None
    return Result(rps, durations[len(durations) // 2], durations[int(len(durations) * 0.99)], cpu, errors)


def admin(port: int, method: str, path: str, body: object) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, data=json.dumps(body).encode(),
                                     headers={"Authorization": "Bearer bench-admin-token",
                                              "Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=10).read()


def wait_http(url: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of load per measurement (default 5)")
    parser.add_argument("--grpc-requests", type=int, default=10000, help="gRPC requests per row at c=32 (10000)")
    parser.add_argument("--only", choices=("all", "http", "grpc"), default="all", help="which rows to measure")
    parser.add_argument("--nginx-only", action="store_true",
                        help="only the c=32 rows against nginx (no direct-to-Triton, access-log or shadow rows)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per side in the nginx rows (3)")
    args = parser.parse_args()
    if not shutil.which("wrk"):
        print("bench: wrk not found (apt-get install wrk, or run `make bench`)", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    script = workdir / "bench.lua"
    script.write_text(LUA)
    (workdir / "gateway.yaml").write_text(POLICY)
    kinds = bodies(workdir)
    print("starting tritonserver ...", flush=True)
    faults = workdir / "faults.json"
    faults.write_text("{}")
    with LocalTriton.on_free_ports(faults_file=faults) as triton:
        port = free_port()
        grpc_port = free_port()
        env = dict(os.environ, GATEWAY_PORT=str(port), GATEWAY_TRITON_URL=triton.http_url, GATEWAY_LOG_LEVEL="warning",
                   GATEWAY_GRPC_PORT=str(grpc_port), GATEWAY_TRITON_GRPC_URL=triton.grpc_url,
                   GATEWAY_STORE_URL="memory://")
        command = [sys.executable, "-m", "gateway", "serve", "--config", str(workdir / "gateway.yaml")]
        gateway = subprocess.Popen(command,
                                   env=env)
        try:
            wait_http(f"http://127.0.0.1:{port}/readyz")
            rows = []
            if args.nginx_only:
                pass
            elif args.only != "grpc":
                rows = http_rows(env, port, gateway, triton, workdir, kinds, script, args, faults)
            if args.nginx_only:
                pass
            elif args.only != "http" and shutil.which("h2load"):
                body = grpc_body(workdir)
                for concurrency in (1, 32):
                    label = f"grpc   c={concurrency:<3}"
                    print(f"  {label} warm-up and measure ...", flush=True)
                    count = args.grpc_requests if concurrency > 1 else args.grpc_requests // 4
                    for target in (triton.grpc_url, f"127.0.0.1:{grpc_port}"):
                        run_h2load(target, body, concurrency, 500, workdir, None)
                    direct, via = alternate(
                        partial(run_h2load, triton.grpc_url, body, concurrency, count, workdir, None),
                        partial(run_h2load, f"127.0.0.1:{grpc_port}", body, concurrency, count, workdir, gateway.pid))
                    rows.append((label, direct, via))
            else:
                print("  (no h2load: gRPC rows skipped; apt-get install nghttp2-client)")
            versus = nginx_rows(triton, port, grpc_port, gateway, workdir, kinds, script, args)
        finally:
            gateway.terminate()
            gateway.wait(10)
    if rows:
        print_table(rows, args.seconds)
    print_versus_nginx(versus, args.rounds)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


def http_rows(env: dict[str, str], port: int, gateway: subprocess.Popen[bytes], triton: LocalTriton,
              workdir: Path, kinds: dict[str, tuple[Path, str]], script: Path, args: argparse.Namespace,
              faults: Path) -> list[tuple[str, Result, Result]]:
    rows: list[tuple[str, Result, Result]] = []
    for kind, (body, ihcl) in kinds.items():
        for concurrency in (1, 32):
            label = f"{kind:<6} c={concurrency:<3}"
            print(f"  {label} warm-up and measure ...", flush=True)
            for target in (triton.http_url, f"http://127.0.0.1:{port}"):
                run_wrk(f"{target}/v2/models/qc/infer", body, ihcl, concurrency, 1, script, None)
            direct = run_wrk(f"{triton.http_url}/v2/models/qc/infer", body, ihcl, concurrency,
                             args.seconds, script, None)
            via = run_wrk(f"http://127.0.0.1:{port}/v2/models/qc/infer", body, ihcl, concurrency,
                          args.seconds, script, gateway.pid)
            rows.append((label, direct, via))
    # The same JSON c=32 load through a second gateway with the access log on (to a file).
    log_port, log_path = free_port(), workdir / "access.log"
    with open(log_path, "w") as log_file:
        logged = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(workdir / "gateway.yaml")],
            env={**env, "GATEWAY_PORT": str(log_port), "GATEWAY_GRPC_PORT": str(free_port()),
                 "GATEWAY_ACCESS_LOG": "true"}, stdout=log_file)
        try:
            wait_http(f"http://127.0.0.1:{log_port}/readyz")
            body, ihcl = kinds["json"]
            print("  json   c=32  with the access log on ...", flush=True)
            run_wrk(f"http://127.0.0.1:{log_port}/v2/models/qc/infer", body, ihcl, 32, 1, script, None)
            off, on = alternate(
                lambda: run_wrk(f"http://127.0.0.1:{port}/v2/models/qc/infer", body, ihcl, 32, args.seconds,
                                script, gateway.pid),
                lambda: run_wrk(f"http://127.0.0.1:{log_port}/v2/models/qc/infer", body, ihcl, 32,
                                args.seconds, script, logged.pid))
            rows.append(("json+log c=32", off, on))
        finally:
            logged.terminate()
            logged.wait(10)
    print(f"  access log: {sum(1 for _ in open(log_path))} lines written")
    rows.append(shadow_row(env, workdir, kinds, script, args.seconds, faults))
    return rows


def nginx_rows(triton: LocalTriton, port: int, grpc_port: int, gateway: subprocess.Popen[bytes], workdir: Path,
               kinds: dict[str, tuple[Path, str]], script: Path,
               args: argparse.Namespace) -> list[tuple[str, Result, Result]]:
    """The c=32 rows once more, alternating nginx and the gateway in front of the same Triton."""
    if not nginx.available():
        print("  (no nginx: the nginx comparison is skipped; `make bench` installs it)")
        return []
    rows: list[tuple[str, Result, Result]] = []
    http_port, h2_port = free_port(), free_port()
    with nginx.Nginx(workdir, f"127.0.0.1:{triton.http_port}", triton.grpc_url, http_port, h2_port) as proxy:
        worker = proxy.worker_pids()[0]
        if args.only != "grpc":
            body, ihcl = kinds["json"]
            print("  json   c=32  nginx and the gateway, alternating ...", flush=True)
            run_wrk(f"http://127.0.0.1:{http_port}/v2/models/qc/infer", body, ihcl, 32, 1, script, None)
            rows.append(("json   c=32",) + alternate(
                partial(run_wrk, f"http://127.0.0.1:{http_port}/v2/models/qc/infer", body, ihcl, 32, args.seconds,
                        script, worker),
                partial(run_wrk, f"http://127.0.0.1:{port}/v2/models/qc/infer", body, ihcl, 32, args.seconds,
                        script, gateway.pid), args.rounds))
        if args.only != "http" and shutil.which("h2load"):
            body = grpc_body(workdir)
            print("  grpc   c=32  nginx and the gateway, alternating ...", flush=True)
            run_h2load(f"127.0.0.1:{h2_port}", body, 32, 500, workdir, None)
            rows.append(("grpc   c=32",) + alternate(
                partial(run_h2load, f"127.0.0.1:{h2_port}", body, 32, args.grpc_requests, workdir, worker),
                partial(run_h2load, f"127.0.0.1:{grpc_port}", body, 32, args.grpc_requests, workdir, gateway.pid),
                args.rounds))
    return rows


def print_versus_nginx(rows: list[tuple[str, Result, Result]], rounds: int = 3) -> None:
    if not rows:
        return
    print("\nThe gateway against nginx (one worker, keep-alive / grpc_pass, no access log) in front of the same "
          f"Triton; medians of {rounds} alternating runs.")
    head = (f"{'load':<12} | {'nginx rps':>9} {'p99 ms':>7} {'cpu us/req':>10} | {'gateway rps':>11} {'p99 ms':>7} "
            f"{'cpu us/req':>10} | {'rps ratio':>9} {'cpu ratio':>9}")
    print(head)
    print("-" * len(head))
    for label, n, g in rows:
        print(f"{label:<12} | {n.rps:>9.0f} {n.p99_us / 1000:>7.2f} {n.cpu_us or 0:>10.0f} | {g.rps:>11.0f} "
              f"{g.p99_us / 1000:>7.2f} {g.cpu_us or 0:>10.0f} | {g.rps / n.rps:>9.2f} "
              f"{(g.cpu_us or 0) / (n.cpu_us or 1):>9.2f}")


def alternate(first: Callable[[], Result], second: Callable[[], Result], rounds: int = 3) -> tuple[Result, Result]:
    """A/B rows on a shared 2-core machine: interleave the runs, keep the median of each."""
    a, b = [], []
    for _ in range(rounds):
        a.append(first())
        b.append(second())
    return median(a), median(b)


def median(results: list[Result]) -> Result:
    def mid(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    return Result(mid([r.rps for r in results]), int(mid([r.p50_us for r in results])),
                  int(mid([r.p99_us for r in results])), mid([r.cpu_us or 0.0 for r in results]),
                  sum(r.errors for r in results))


def shadow_row(env: dict[str, str], workdir: Path, kinds: dict[str, tuple[Path, str]], script: Path,
               seconds: float, faults: Path) -> tuple[str, Result, Result]:
    """JSON c=32 through a gateway at qc 2=100%, then with 100% mirrored to a version made
    20 ms slower: the client's latency must not follow the shadow's."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "gateway", "serve"], env={
        **env, "GATEWAY_PORT": str(port), "GATEWAY_GRPC_PORT": str(free_port()),
        "GATEWAY_ADMIN_TOKEN": "bench-admin-token"}, stdout=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz")
        admin(port, "PUT", "/admin/models/qc/policy", {"weights": {"2": 100}})
        body, ihcl = kinds["json"]
        url = f"http://127.0.0.1:{port}/v2/models/qc/infer"
        print("  json   c=32  without and with a 100% shadow to a slow version ...", flush=True)
        run_wrk(url, body, ihcl, 32, 1, script, None)
        faults.write_text(json.dumps({"qc": {"3": {"delay_ms": 20}}}))

        def measure(shadow: bool) -> Result:
            policy: dict[str, object] = {"weights": {"2": 100}}
            if shadow:
                policy["shadow"] = {"version": "3", "percent": 100}
            admin(port, "PUT", "/admin/models/qc/policy", policy)
            time.sleep(0.3)
            return run_wrk(url, body, ihcl, 32, seconds, script, process.pid)

        off, on = alternate(lambda: measure(False), lambda: measure(True))
        faults.write_text("{}")
    finally:
        process.terminate()
        process.wait(10)
    return "shadow c=32", off, on


def print_table(rows: list[tuple[str, Result, Result]], seconds: float) -> None:
    print(f"\nHTTP rows: {seconds:g} s of wrk load per cell; gRPC rows: h2load, fixed request count. Model qc "
          "(Python backend); load generator, gateway and Triton share the same 2 cores.")
    head = (f"{'load':<12} | {'direct rps':>10} {'p50 ms':>7} {'p99 ms':>7} | {'gateway rps':>11} {'p50 ms':>7} "
            f"{'p99 ms':>7} {'cpu us/req':>10} | {'rps ratio':>9} {'p50 +ms':>7} | errors")
    print(head)
    print("-" * len(head))
    for label, d, g in rows:
        print(f"{label:<12} | {d.rps:>10.0f} {d.p50_us / 1000:>7.2f} {d.p99_us / 1000:>7.2f} | {g.rps:>11.0f} "
              f"{g.p50_us / 1000:>7.2f} {g.p99_us / 1000:>7.2f} {g.cpu_us or 0:>10.0f} | {g.rps / d.rps:>9.2f} "
              f"{(g.p50_us - d.p50_us) / 1000:>7.2f} | {d.errors}/{g.errors}")
    print("json+log row: the left columns are the gateway with the access log off, the right ones with it on.")
    print("A/B rows (json+log, shadow) and the gRPC rows interleave 3 runs of each side and show the medians.")
    print("shadow row: left, qc 2=100% alone; right, the same with 100% mirrored to version 3 made 20 ms slower.")


if __name__ == "__main__":
    raise SystemExit(main())
