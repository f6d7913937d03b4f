"""What a start with 5,000 stored policies does per model: counted, never timed.

Issue 36's target is startup at 5,000 models <= 3 s; it took 2.7-6.2 s under load. Profiled
(cProfile, ``gateway serve`` against bench/stub_triton.py --models 5,000), the part that grew with
the models was: a few full garbage collections while the policies were read and compiled, each
walking everything the imports had built (~0.5 s of ~0.9 s); validating every stored policy
(pydantic, once per record even where 5,000 records hold a few texts); and reading Triton's
config of every model only after the policies were read. Now the imports' objects are frozen
before the policies are read, a stored text is validated once, and the configs are read while
the policies are.
"""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import Any

import pytest

from gateway.app import Gateway
from gateway.devtools.local_triton import free_port
from gateway.policy import PolicySpec
from gateway.policy_book import PolicyBook
from gateway.services.policies import PolicyService
from gateway.services.state_sync import StateSync
from gateway.settings import Settings
from gateway.store.base import EventDraft
from gateway.store.memory import InMemoryStore
from gateway.store.sqlite import SQLiteStore
from tests.scale_triton import ScaleTriton
from tests.support import TOKEN

SPECS = [PolicySpec.model_validate({"weights": {"2": 80, "3": 20}}),
         PolicySpec.model_validate({"weights": {"2": 100}})]


async def test_a_first_read_of_2000_stored_policies_validates_each_distinct_text_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = SQLiteStore(tmp_path / "state.db")
    await writer.open()
    try:
        for index in range(2000):
            await writer.put_policy(f"m{index:05d}", SPECS[index % 2], None, EventDraft("test", "put_policy"))
    finally:
        await writer.close()
    validated = [0]
    validate = PolicySpec.model_validate.__func__  # type: ignore[attr-defined]

    def counted(cls: Any, *args: Any, **kwargs: Any) -> Any:
        validated[0] += 1
        return validate(cls, *args, **kwargs)

    monkeypatch.setattr(PolicySpec, "model_validate", classmethod(counted))
    store = SQLiteStore(tmp_path / "state.db")  # a starting gateway's: nothing read yet
    await store.open()
    try:
        book = PolicyBook()
        await StateSync(store, PolicyService(store, book, None), resync_interval_s=60).resync()  # type: ignore[arg-type]
    finally:
        await store.close()
    assert len(book.snapshot()) == 2000
    assert validated[0] == 2, f"{validated[0]} validations for 2,000 records of 2 texts"
    first, second = book.get("m00000"), book.get("m00001")
    assert first is not None and second is not None and first.spec == SPECS[0] and second.spec == SPECS[1]


async def test_the_policies_are_read_with_the_imports_objects_frozen_and_the_configs_read_meanwhile() -> None:
    gc.unfreeze()  # whatever an earlier test froze: this start's own freezing is what is looked at
    seen: dict[str, Any] = {}
    async with ScaleTriton(300) as triton:
        settings = Settings.load(None, host="127.0.0.1", port=free_port(), triton_url=triton.url, admin_token=TOKEN,
                                 grpc_enabled=False, controller_enabled=False, store_url="memory://",
                                 fleet_health_interval_s=60)
        app = Gateway(settings, store=InMemoryStore())
        resync, first_look = app.sync.resync, app.sequence_models.first_look

        async def watched_resync() -> None:
            seen.setdefault("frozen", gc.get_freeze_count())
            await asyncio.sleep(0.05)  # the store's answer takes a while: the configs are read meanwhile
            seen.setdefault("configs_during_resync", triton.asked["config"])
            await resync()

        async def watched_first_look(timeout_s: float) -> None:
            await first_look(timeout_s)
            seen["configs_read"] = triton.asked["config"]

        app.sync.resync = watched_resync  # type: ignore[method-assign]
        app.sequence_models.first_look = watched_first_look  # type: ignore[method-assign]
        async with app.running():
            pass
    assert seen["frozen"] > 10_000, "the objects the imports built are frozen before the policies are read"
    assert seen["configs_read"] >= 300 and seen["configs_during_resync"] > 0, seen


def test_the_texts_kept_for_validation_stay_bounded_by_the_records() -> None:
    """With a resync that reads only what was written, full reads (which drop texts no record has)
    are rare: the texts kept are bounded by the records themselves, however many writes."""
    from gateway.store.records import SpecCache, stored_spec

    cache = SpecCache()
    for write in range(5_000):
        spec = PolicySpec.model_validate({"weights": {"2": 100 - write % 100, "3": write % 100}, "sticky_header":
                                          f"x-{write}"})
        cache.spec(f"m{write % 10}", json_text(stored_spec(spec)), "test")
    assert len(cache._by_text) <= 2 * 10 + 64 + 1


def json_text(document: object) -> str:
    import json

    return json.dumps(document)
