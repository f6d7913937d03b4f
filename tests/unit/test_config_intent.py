"""The config file as declared intent, decided against a real SQLite store."""

from __future__ import annotations

from pathlib import Path

from gateway.policy import PolicySpec
from gateway.services.config_intent import apply_declared
from gateway.store.base import EventDraft
from gateway.store.sqlite import SQLiteStore

FILE_A = PolicySpec.model_validate({"weights": {"2": 80, "3": 20}})
FILE_B = PolicySpec.model_validate({"weights": {"2": 99.5, "3": 0.5}})
API = PolicySpec.model_validate({"weights": {"2": 50, "3": 50}})


async def test_first_start_over_a_store_with_history_takes_the_store_and_a_later_edit_applies(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "state.db")
    await store.open()
    await store.put_policy("qc", API, 0, EventDraft("alice", "put_policy"))  # written before digests were kept
    await store.put_policy("tok", FILE_A, 0, EventDraft("settings", "seed"))
    assert await apply_declared(store, {"qc": FILE_A, "tok": FILE_A}) == {"qc": "differ", "tok": "kept"}
    assert (await store.get_policy("qc")).revision == 1  # type: ignore[union-attr]
    assert await apply_declared(store, {"qc": FILE_B, "tok": FILE_A}) == {"qc": "applied", "tok": "kept"}
    qc = await store.get_policy("qc")
    assert qc is not None and (qc.spec, qc.revision, qc.actor) == (FILE_B, 2, "config")
    await store.close()


async def test_a_policy_deleted_through_the_api_stays_deleted_until_the_file_entry_changes(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "state.db")
    await store.open()
    assert await apply_declared(store, {"qc": FILE_A}) == {"qc": "applied"}
    await store.put_policy("qc", None, 1, EventDraft("alice", "delete_policy"))
    assert await apply_declared(store, {"qc": FILE_A}) == {"qc": "differ"}
    assert (await store.get_policy("qc")).spec is None  # type: ignore[union-attr]
    assert await apply_declared(store, {"qc": FILE_B}) == {"qc": "applied"}
    assert (await store.get_policy("qc")).revision == 3  # type: ignore[union-attr]
    await store.close()


async def test_two_replicas_starting_together_apply_a_changed_entry_once(tmp_path: Path) -> None:
    import asyncio

    first, second = SQLiteStore(tmp_path / "state.db"), SQLiteStore(tmp_path / "state.db")
    await first.open()
    await second.open()
    await apply_declared(first, {"qc": FILE_A})
    outcomes = await asyncio.gather(apply_declared(first, {"qc": FILE_B}), apply_declared(second, {"qc": FILE_B}))
    assert sorted(o["qc"] for o in outcomes) == ["applied", "kept"]
    assert (await first.get_policy("qc")).revision == 2  # type: ignore[union-attr]
    assert [e.action for e in await first.events("qc")] == ["apply_config", "apply_config"]
    await first.close()
    await second.close()
