"""What a tick costs for rollouts with nothing new: counted, never timed.

Issue 36's target is 50 running rollouts at 5,000 models in <= 25 ms CPU a second with no traffic;
it stood at 23-26. Most of an idle tick was pydantic: each tick validated every rollout's stored
spec again (``Rollout.from_document``) and serialized every rollout again (``Rollout.document``,
two ``model_dump`` calls) only to find it equal to the stored record. Now a rollout whose stored
document did not change is the one read before, and one that the tick left as it was is not
serialized; a rollout whose record changed is read again.
"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.rollout.spec import RolloutSpec
from gateway.rollout.steps import Rollout
from tests.scale_triton import ScaleTriton
from tests.unit.test_triton_reads_scale import gateway, start_rollouts

ROLLOUTS = 50


async def test_ticks_over_fifty_idle_rollouts_validate_and_serialize_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    async with ScaleTriton(200) as triton, gateway(triton, controller_tick_s=1.0) as app:
        models, clock = await start_rollouts(app, ROLLOUTS)
        await app.rollouts.tick()  # the first weights applied, every record read once
        await app.rollouts.tick()
        validated, serialized = [0], [0]
        validate, document = RolloutSpec.model_validate.__func__, Rollout.document  # type: ignore[attr-defined]

        def counted_validate(cls: Any, *args: Any, **kwargs: Any) -> Any:
            validated[0] += 1
            return validate(cls, *args, **kwargs)

        def counted_document(self: Rollout) -> dict[str, Any]:
            serialized[0] += 1
            return document(self)

        monkeypatch.setattr(RolloutSpec, "model_validate", classmethod(counted_validate))
        monkeypatch.setattr(Rollout, "document", counted_document)
        for _ in range(3):
            clock.now += 1.0
            await app.rollouts.tick()
        assert (validated[0], serialized[0]) == (0, 0), \
            f"{validated[0]} specs validated and {serialized[0]} rollouts serialized in 3 idle ticks of {ROLLOUTS}"
        assert all(app.recorder.rollout_states[model][0] == "progressing" for model in models)
        # a record that changed is read again: a pause through the admin path reaches the tick
        await app.rollouts.command(models[7], "pause", "test")
        await app.rollouts.tick()
        assert app.recorder.rollout_states[models[7]][0] == "paused" and validated[0] >= 1
