"""The control plane's sweeps (issue 36): what a scrape, a tick, a worker report and an admin
change cost as the repository grows. Registered in ``bench/scale_harness.py``'s ``SWEEPS``.

``models``: for each size (``--models``, default 1,100,1000,5000; the stub lists that many
models and the store holds a policy for each), one gateway process per round:

- startup: process start to ``/readyz``;
- idle CPU per second with no traffic, and Triton repository-index reads per second (the
  stub counts them), without rollouts and with ``--rollouts`` running (50; ``interval_s``
  3600, so each one ticks without a verdict): the difference per rollout is a tick's cost;
- a policy PUT: milliseconds, and the stub's calls during the PUTs;
- an active client (wrk, 8 connections, model qc) alone and while ``/metrics`` is scraped every
  second (ABBA, within the run): its worst and p99 latency, and the scrape's size and time;
- traffic on every model, then the exposition again and the process' RSS.

``workers``: ``--workers`` 1 and 2, traffic over 1 and ``--traffic-models`` (1,000) models:
whole-tree CPU per request, and the supervisor's (control plane's) CPU per second under load; one
gateway per worker count and round serves both, its one-model and spread runs alternating ABBA.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from statistics import median
from typing import Any

import scale_harness
from scale_harness import (
    Scraper,
    Stub,
    Table,
    call,
    exposition,
    gateway,
    model_names,
    prepare_store,
    rss_mb,
    spread,
    stubs,
    sweep,
    workdir,
    wrk,
)

ROLLOUT = {"canary": "3", "stable": "2", "steps": [5, 20, 50, 100], "interval_s": 3600}


def _sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("models and workers sweeps (issue 36)")
    group.add_argument("--models", default="1,100,1000,5000", help="repository sizes (comma-separated)")
    group.add_argument("--rollouts", type=int, default=50, help="rollouts running in the second idle window")
    group.add_argument("--idle-s", type=float, default=5.0, help="seconds of each idle CPU window")
    group.add_argument("--load-s", type=float, default=5.0, help="seconds of each wrk run")
    group.add_argument("--traffic-models", type=int, default=1000, help="workers sweep: models with traffic")


def _idle(process: Any, stub: Stub, seconds: float) -> tuple[float, float]:
    """(CPU ms per second, repository index reads per second) with no traffic."""
    meter, before = process.own(), stub.counts().get("index", 0)
    meter.start()
    time.sleep(seconds)
    cpu = meter.stop()
    return cpu / seconds * 1000, (stub.counts().get("index", 0) - before) / seconds


def _start_rollouts(url: str, models: list[str]) -> None:
    for model in models:
        status, body = call(f"{url}/admin/models/{model}/rollout", "POST", ROLLOUT)
        if status not in (200, 201):
            raise RuntimeError(f"rollout of {model}: {status} {body[:200]!r}")

    def applied() -> bool:
        import json

        return all(json.loads(call(f"{url}/admin/models/{model}/rollout")[1]).get("applied") for model in models)

    deadline = time.monotonic() + 120
    while not applied():
        if time.monotonic() > deadline:
            raise RuntimeError("the rollouts' first weights were not applied within 120 s")
        time.sleep(0.5)


def _puts(url: str, stub: Stub, model: str, count: int = 10) -> tuple[float, float]:
    """(median ms per PUT, stub calls of every kind but inference per PUT, background included)."""
    before, spent = stub.counts(), []
    for index in range(count):
        weights = {"2": 80, "3": 20} if index % 2 else {"2": 70, "3": 30}
        at = time.monotonic()
        status, body = call(f"{url}/admin/models/{model}/policy", "PUT", {"weights": weights})
        spent.append((time.monotonic() - at) * 1000)
        if status != 200:
            raise RuntimeError(f"PUT {model}: {status} {body[:200]!r}")
    after = stub.counts()
    calls = sum(after.get(kind, 0) - before.get(kind, 0) for kind in after if kind != "infer")
    return median(spent), calls / count


def _scrape_latency(url: str, seconds: float, tmp: Path) -> dict[str, float]:
    """An active client's worst / p99 latency alone and while /metrics is scraped every second
    (ABBA within one run). Each run outlasts two scrapes: wrk counts only the requests that
    finished within its run, so a run shorter than a stall would not see the stall."""
    _, _, one_scrape_s = exposition(url)
    seconds = max(seconds, 2 * one_scrape_s + 2)
    alone, scraped, scrapes = [], [], []
    for with_scrape in (False, True, True, False):
        if with_scrape:
            with Scraper(url) as scraper:
                run = wrk(url, 1, seconds, 8, tmp)
            scraped.append(run)
            scrapes += scraper.seconds
        else:
            alone.append(wrk(url, 1, seconds, 8, tmp))
    return {"max_alone_ms": max(r["max_ms"] for r in alone), "max_scraped_ms": max(r["max_ms"] for r in scraped),
            "p99_alone_ms": median(r["p99_ms"] for r in alone), "p99_scraped_ms": median(r["p99_ms"] for r in scraped),
            "rps_ratio": sum(r["rps"] for r in scraped) / max(1.0, sum(r["rps"] for r in alone)),
            "scrapes": len(scrapes), "scrape_s": max(scrapes) if scrapes else 0.0}


def _one_size(stub: Stub, store: Path, args: argparse.Namespace, tmp: Path, tree: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"models": stub.models}
    names = model_names(stub.models)
    with gateway(stub, store, tree=tree) as process:
        row["startup_s"] = process.startup_s
        row["idle_ms_s"], row["index_s"] = _idle(process, stub, args.idle_s)
        row["put_ms"], row["put_calls"] = _puts(process.url, stub, names[-1])
        rollouts = names[:min(args.rollouts, len(names))]
        _start_rollouts(process.url, rollouts)
        row["rollouts"] = len(rollouts)
        row["ro_idle_ms_s"], row["ro_index_s"] = _idle(process, stub, args.idle_s)
        row["ms_s_per_rollout"] = (row["ro_idle_ms_s"] - row["idle_ms_s"]) / len(rollouts)
        row.update(_scrape_latency(process.url, args.load_s, tmp))
        row["mb"], row["series"], _ = exposition(process.url)
        row["mb"] /= 1e6
        warm_s = max(2.0, stub.models * 4 / 1500)
        wrk(process.url, stub.models, warm_s, 32, tmp, threads=2)
        size, row["series_all"], row["scrape_all_s"] = exposition(process.url)
        row["mb_all"] = size / 1e6
        row["rss_mb"] = rss_mb(process.pids())
    return row


@sweep("models", "repository sizes: startup, idle CPU with and without rollouts, PUT, scrape size and stall")
def models_sweep(args: argparse.Namespace) -> list[Table]:
    sizes = _sizes(args.models)
    configurations = [(label, size) for size in sizes for label in scale_harness.TREES]
    rows: dict[tuple[str, int], list[dict[str, Any]]] = {config: [] for config in configurations}
    with workdir() as tmp, stubs(sizes) as started:
        stores = {}
        for size in sizes:
            stores[size] = tmp / f"policies-{size}.db"
            prepare_store(stores[size], model_names(size))
        for round_ in range(args.rounds):
            for label, size in configurations if round_ % 2 == 0 else list(reversed(configurations)):
                store = tmp / f"run-{size}-{round_}.db"
                shutil.copy(stores[size], store)  # every run starts from the same stored policies
                row = _one_size(started[size], store, args, tmp, scale_harness.TREES[label])
                rows[(label, size)].append(row)
                print(f"round {round_ + 1} {label} models={size}: " + ", ".join(
                    f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
                    for key, value in row.items()), flush=True)
    return _tables(rows, args)


def _tables(rows: dict[tuple[str, int], list[dict[str, Any]]], args: argparse.Namespace) -> list[Table]:
    def column(config: tuple[str, int], key: str) -> str:
        return spread([float(row[key]) for row in rows[config]])

    control = Table("models: the control plane's cost by repository size (min / median / max over rounds)",
                    ["gateway", "models", "startup s", "idle ms CPU/s", "index reads/s", "rollouts",
                     "idle ms CPU/s, rollouts", "index reads/s, rollouts", "ms CPU/s per rollout", "PUT ms",
                     "stub calls per PUT", "RSS MB"])
    scrape = Table("models: /metrics by repository size (policies on every model)",
                   ["gateway", "models", "MB (qc traffic)", "series (qc traffic)", "worst ms alone",
                    "worst ms scraped", "p99 ms alone", "p99 ms scraped", "req/s scraped / alone", "slowest scrape s",
                    "MB (every model)", "series (every model)", "scrape s (every model)"])
    for config, found in rows.items():
        label, size = config
        control.rows.append({"gateway": label, "models": size, "startup s": column(config, "startup_s"),
                             "idle ms CPU/s": column(config, "idle_ms_s"), "index reads/s": column(config, "index_s"),
                             "rollouts": found[0]["rollouts"],
                             "idle ms CPU/s, rollouts": column(config, "ro_idle_ms_s"),
                             "index reads/s, rollouts": column(config, "ro_index_s"),
                             "ms CPU/s per rollout": column(config, "ms_s_per_rollout"),
                             "PUT ms": column(config, "put_ms"), "stub calls per PUT": column(config, "put_calls"),
                             "RSS MB": column(config, "rss_mb")})
        scrape.rows.append({"gateway": label, "models": size, "MB (qc traffic)": column(config, "mb"),
                            "series (qc traffic)": column(config, "series"),
                            "worst ms alone": column(config, "max_alone_ms"),
                            "worst ms scraped": column(config, "max_scraped_ms"),
                            "p99 ms alone": column(config, "p99_alone_ms"),
                            "p99 ms scraped": column(config, "p99_scraped_ms"),
                            "req/s scraped / alone": column(config, "rps_ratio"),
                            "slowest scrape s": column(config, "scrape_s"),
                            "MB (every model)": column(config, "mb_all"),
                            "series (every model)": column(config, "series_all"),
                            "scrape s (every model)": column(config, "scrape_all_s")})
    control.notes.append(f"{args.rounds} round(s), sizes interleaved (order flipped every round); one gateway process "
                         f"per size and round; idle windows {args.idle_s:g} s; stub calls per PUT include the "
                         "background health checks during the PUTs")
    scrape.notes.append(f"the active client: wrk -c8 on qc, runs of {args.load_s:g} s (or two scrapes' time) "
                        "alone and while /metrics is scraped every second, ABBA within one gateway run; "
                        "'every model': after wrk over all models")
    return [control, scrape]


@sweep("workers", "--workers 1 and 2 with traffic over 1 and --traffic-models models: CPU per request, supervisor")
def workers_sweep(args: argparse.Namespace) -> list[Table]:
    spread_over = (1, args.traffic_models)
    # One gateway per worker count, tree and round serves both: its runs over one model and over the
    # spread alternate inside it (ABBA, the order flipped every round), so their ratio is of runs
    # seconds apart in the same processes. Measured in separate processes minutes apart on a shared
    # machine, identical code read +7% in one round and +16% in the next.
    processes = [(label, workers) for workers in (1, 2) for label in scale_harness.TREES]
    rows: dict[tuple[str, int, int], list[dict[str, float]]] = {
        (label, workers, models): [] for label, workers in processes for models in spread_over}
    half_s = max(1, round(args.load_s / 2))  # wrk runs whole seconds
    with workdir() as tmp, stubs([args.traffic_models]) as started:
        stub = started[args.traffic_models]
        policies = tmp / "policies.db"
        prepare_store(policies, model_names(args.traffic_models))
        for round_ in range(args.rounds):
            for label, workers in processes if round_ % 2 == 0 else list(reversed(processes)):
                store = tmp / f"run-{workers}-{round_}.db"
                shutil.copy(policies, store)
                order = spread_over if round_ % 2 == 0 else spread_over[::-1]
                sums = {models: [0.0, 0.0, 0.0, 0.0] for models in spread_over}  # CPU s, requests, own CPU s, errors
                with gateway(stub, store, workers=workers, tree=scale_harness.TREES[label]) as process:
                    for models in order:  # warm: pools, every model's series
                        wrk(process.url, models, 1, 32, tmp, threads=2)
                    for models in (*order, *order[::-1]):
                        whole, own = process.whole(), process.own()
                        whole.start()
                        own.start()
                        run = wrk(process.url, models, half_s, 32, tmp, threads=2)
                        for at, value in enumerate((whole.stop(), run["requests"], own.stop(), run["errors"])):
                            sums[models][at] += value
                for models, (tree_s, requests, own_s, errors) in sums.items():
                    row = {"cpu_us_per_request": tree_s / max(1.0, requests) * 1e6, "rps": requests / (2 * half_s),
                           "errors": errors, "supervisor_ms_s": own_s / (2 * half_s) * 1000 if workers > 1 else 0.0}
                    rows[(label, workers, models)].append(row)
                    print(f"round {round_ + 1} {label} workers={workers} models={models}: " +
                          ", ".join(f"{key} {value:.4g}" for key, value in row.items()), flush=True)
    table = Table("workers: CPU per request and the control plane's cost (min / median / max over rounds)",
                  ["gateway", "workers", "models with traffic", "us CPU/request (whole tree)", "vs 1 model",
                   "req/s", "supervisor ms CPU/s", "errors"])
    for (label, workers, models), found in rows.items():
        one_model = rows[(label, workers, 1)]
        ratios = [(row["cpu_us_per_request"] / base["cpu_us_per_request"] - 1) * 100
                  for row, base in zip(found, one_model)]
        table.rows.append({"gateway": label, "workers": workers, "models with traffic": models,
                           "us CPU/request (whole tree)": spread([r["cpu_us_per_request"] for r in found]),
                           "vs 1 model": spread(ratios) + " %", "req/s": spread([r["rps"] for r in found]),
                           "supervisor ms CPU/s": spread([r["supervisor_ms_s"] for r in found]) if workers > 1 else "-",
                           "errors": int(sum(r["errors"] for r in found))})
    table.notes.append(f"{args.rounds} round(s), one gateway per worker count, tree and round; inside it wrk -t2 "
                       f"-c32 over one model and over the spread alternate ABBA, {half_s} s per run ({2 * half_s} s "
                       "each); 'vs 1 model': over the one-model runs of the same gateway")
    return [table]
