"""What an SRE asks for when starting a rollout (``POST /admin/models/{model}/rollout``)."""

from __future__ import annotations

from decimal import Decimal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.policy import Percent, TargetKey


class RolloutSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    canary: TargetKey = Field(description="the new version (fleet:version for a version on a named fleet)")
    stable: TargetKey | None = Field(None, description="default: the version now taking most traffic")
    steps: list[Percent] = Field(default_factory=lambda: [Decimal(5), Decimal(20), Decimal(50), Decimal(100)],
                                 min_length=1, max_length=20, description="canary percent per step, ascending")
    interval_s: float = Field(30.0, ge=1, le=86_400, description="seconds per analysis interval")
    max_error_rate: float | None = Field(0.01, ge=0, le=1, description="upstream errors / requests")
    max_p99_ms: float | None = Field(None, gt=0, description="absolute p99 latency limit")
    max_p99_ratio: float | None = Field(1.5, gt=1, description="canary p99 / stable p99 over the same window")
    min_p99_delta_ms: float = Field(10.0, ge=0, description="p99 ratio breaches count only past this many ms "
                                    "(histogram buckets make tiny latencies jumpy)")
    min_requests: int = Field(50, ge=1, description="canary requests per interval below which there is no verdict")
    failure_limit: int = Field(2, ge=1, le=100, description="consecutive unhealthy verdicts before rollback")
    error_limit: int = Field(3, ge=1, le=100, description="consecutive metric read errors before the rollout pauses")
    manual_gates: bool = Field(False, description="wait for a promote after every healthy step")
    unload_previous: bool = Field(False, description="after promotion, drain and unload previous versions that "
                                  "no longer take traffic")
    keep_previous: int = Field(0, ge=0, le=10, description="with unload_previous: keep this many of the newest "
                               "previous versions loaded, for an instant rollback")

    @field_validator("steps")
    @classmethod
    def _ascending(cls, steps: list[Decimal]) -> list[Decimal]:
        if any(step <= 0 for step in steps):
            raise ValueError("steps must be above 0 percent")
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError("steps must be strictly ascending")
        return steps

    @model_validator(mode="after")
    def _distinct_versions(self) -> RolloutSpec:
        if self.stable is not None and self.stable == self.canary:
            raise ValueError("stable and canary must be different versions")
        return self

    def document(self) -> dict[str, object]:
        doc = self.model_dump(mode="json")
        doc["steps"] = [float(s) if s != int(s) else int(s) for s in self.steps]
        return doc
