"""What a model with a policy costs in memory, and what bounds it: counted (tracemalloc), never timed.

A whole gateway (SQLite store, the default) is started over 100 and then 1,000 stored policies
against one repository, and the bytes Python holds are read once it is ready and again after
one request of every model has been recorded and /metrics rendered; the difference between
the two sizes, per model, is what a model with a policy costs. docs/benchmarks.md#scale states
the figures; what bounds the whole is MAX_SERIES (label sets past it fold into one overflow
series: tests/unit/test_recorder.py) and the policies the operator stores.

Before issue 36 a version with traffic kept a per-second histogram of 31 buckets for every
second of the horizon (~107 KB per version): 1,000 models with traffic held ~110 MB.
"""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

from gateway.app import Gateway
from gateway.devtools.local_triton import free_port
from gateway.policy import PolicySpec
from gateway.settings import Settings
from gateway.store.base import EventDraft
from gateway.store.sqlite import SQLiteStore
from gateway.telemetry.recorder import Outcome
from tests.scale_triton import ScaleTriton, names
from tests.support import TOKEN

SPEC = PolicySpec.model_validate({"weights": {"2": 80, "3": 20}})
IDLE_BYTES_PER_MODEL = 8 * 1024  # measured ~3 KB: compiled policy, stored spec, index and config entries
BUSY_BYTES_PER_MODEL = 40 * 1024  # measured ~18 KB: + one version's series, totals and histogram


async def held_bytes(triton: ScaleTriton, models: int, tmp_path: Path) -> tuple[int, int]:
    """(bytes held once ready, bytes held after one request of every model and a scrape)."""
    path = tmp_path / f"state-{models}.db"
    store = SQLiteStore(path)
    await store.open()
    try:
        for model in names(models):
            await store.put_policy(model, SPEC, None, EventDraft("test", "put_policy"))
    finally:
        await store.close()
    settings = Settings.load(None, host="127.0.0.1", port=free_port(), triton_url=triton.url, admin_token=TOKEN,
                             grpc_enabled=False, controller_enabled=False, store_url=f"sqlite:///{path}",
                             fleet_health_interval_s=60)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        app = Gateway(settings)
        async with app.running():
            ready = tracemalloc.get_traced_memory()[0] - before
            for model in names(models):
                app.recorder.record(model, "2", Outcome.SUCCESS, 0.004, "weighted", "http", "200")
            body, _ = await app.registry.render(None)
            assert f'model="m{models - 1:05d}"'.encode() in body
            del body
            gc.collect()
            busy = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return ready, busy


async def test_a_model_with_a_policy_costs_a_few_kilobytes_and_its_traffic_a_few_more(tmp_path: Path) -> None:
    async with ScaleTriton(1000) as triton:
        await held_bytes(triton, 10, tmp_path)  # warm: what the first gateway of the process builds once
        small_ready, small_busy = await held_bytes(triton, 100, tmp_path)
        large_ready, large_busy = await held_bytes(triton, 1000, tmp_path)
    idle, busy = (large_ready - small_ready) / 900, (large_busy - small_busy) / 900
    assert 0 < idle <= IDLE_BYTES_PER_MODEL, f"{idle / 1024:.1f} KB per model with a policy, once ready"
    assert idle < busy <= BUSY_BYTES_PER_MODEL, f"{busy / 1024:.1f} KB per model with a policy and traffic"
