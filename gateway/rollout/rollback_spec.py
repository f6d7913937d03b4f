"""What a rollout spec says about going back to the stable (``rollback: {mode, steps}``);
validated here, so a bad descent is a 422 at ``POST /admin/models/{model}/rollout``.
The behaviour is described in :mod:`gateway.rollout.rollback`."""

from __future__ import annotations

from decimal import Decimal
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.policy import Percent


class RollbackSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["immediate", "gradual"] = Field(
        "immediate", description="immediate: an unhealthy canary goes to 0% in one move; gradual: down through "
        "`steps`, one per interval (critical failures are always immediate)")
    steps: list[Percent] = Field(default_factory=lambda: [Decimal(50), Decimal(20), Decimal(0)], min_length=1,
                                 max_length=20, description="gradual: canary percents on the way down, strictly "
                                 "descending, ending at 0; only those below the canary's weight are used")

    @field_validator("steps")
    @classmethod
    def _descending_to_zero(cls, steps: list[Decimal]) -> list[Decimal]:
        if any(b >= a for a, b in zip(steps, steps[1:])):
            raise ValueError("rollback steps must be strictly descending")
        if steps[-1] != 0:
            raise ValueError("rollback steps must end at 0 (the canary takes no traffic once rolled back)")
        return steps

    def descent_from(self, percent: Decimal) -> int:
        """Index of the first rollback step below ``percent`` (there is one: the last is 0)."""
        return next(i for i, step in enumerate(self.steps) if step < percent)


class FailureClasses(BaseModel):
    """What a canary judged unhealthy ``failure_limit`` intervals in a row does, by the class of
    its failure (``judge.failure_class``): roll back, or pause for an operator."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["roll_back", "pause"] = Field(
        "roll_back", description="the model: its errors (Triton's BACKEND), a latency in its compute or outside "
        "Triton, 4xx, streaming times, checks")
    capacity: Literal["roll_back", "pause"] = Field(
        "roll_back", description="its capacity: answers its queue refused (Triton's REJECTED: full or timed out), "
        "or a latency Triton's timings put in the queue. pause: 'canary under-provisioned: queue', so an operator "
        "adds instances and resumes rather than throws the model away")
