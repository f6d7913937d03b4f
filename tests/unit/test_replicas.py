"""The model lifecycle lock spans processes: two replicas on one real SQLite file."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.errors import Conflict
from gateway.sequences import SequencePins
from gateway.services.replicas import Replicas
from gateway.store.sqlite import SQLiteStore
from gateway.telemetry.recorder import Recorder


async def test_one_load_or_unload_of_a_model_at_a_time_across_replicas(tmp_path: Path) -> None:
    stores = [SQLiteStore(tmp_path / "state.db"), SQLiteStore(tmp_path / "state.db")]
    for store in stores:
        await store.open()
    a, b = (Replicas(store, Recorder(), SequencePins(), replica=name) for store, name in zip(stores, "ab"))
    order: list[str] = []

    async def reload(replicas: Replicas, wait_s: float) -> None:
        async with replicas.lock("qc", wait_s):
            order.append(f"{replicas.replica} in")
            await asyncio.sleep(0.3)
            order.append(f"{replicas.replica} out")

    first = asyncio.ensure_future(reload(a, 1))
    await asyncio.sleep(0.05)
    with pytest.raises(Conflict, match="another load or unload of model 'qc'"):
        await reload(b, 0.1)
    await reload(b, 2)  # waits for a's reload, then runs
    await first
    assert order == ["a in", "a out", "b in", "b out"]
    async with a.lock("tok", 0.1), b.lock("qc", 0.1):  # other models are not held up
        pass
    for store in stores:
        await store.close()
