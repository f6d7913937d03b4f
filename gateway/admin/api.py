"""The admin REST API under /admin: policies, models, audit trail (rollouts in admin/rollouts).

Every endpoint needs ``Authorization: Bearer <token>``; the token's name is the actor in
the audit trail. Invalid requests are answered 4xx with Triton's ``{"error": "..."}`` shape
and change nothing.
"""

# No `from __future__ import annotations` here: FastAPI resolves route annotations at
# runtime, and the routes close over per-app dependencies defined in admin_router().
from decimal import Decimal
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from gateway.admin.deps import ERRORS, Actor, ModelName
from gateway.errors import BadRequest
from gateway.policy import PolicySpec, SequenceAffinity, Weights
from gateway.rollout import effects
from gateway.services.policies import PolicyService
from gateway.store.base import EventDraft, StoredPolicy


class WeightsChange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weights: Weights = Field(description="version (or fleet:version) -> percent, summing to 100")
    reason: str | None = Field(None, max_length=1000)


class PolicyOut(BaseModel):
    model: str
    weights: dict[str, float | int]
    sticky_header: str | None
    rules: list[dict[str, Any]]
    shadow: dict[str, Any] | None = None
    sequence_affinity: SequenceAffinity = "auto"
    revision: int
    updated_at: float
    warnings: list[str] = Field(default_factory=list, description="what the change did beyond what it names: a "
                                "rollout it paused, a header rule it dropped (gateway/rollout/effects.py)")


def parse_if_match(value: str | None) -> int | None:
    if value is None:
        return None
    text = value.strip().removeprefix("W/").strip('"')
    if not text.isdigit():
        raise BadRequest(f"If-Match must be a policy revision (the ETag), not {value!r}")
    return int(text)


def policy_response(stored: StoredPolicy, response: Response, warnings: list[str] | None = None) -> dict[str, Any]:
    response.headers["ETag"] = f'"{stored.revision}"'
    return {**stored.document(), "warnings": warnings or []}


def held(policies: PolicyService, model: str) -> PolicySpec | None:
    """The model's policy as this replica's book holds it: what a change's warnings compare with."""
    policy = policies.book.get(model)
    return policy.spec if policy is not None else None


def admin_router(policies: PolicyService) -> APIRouter:
    IfMatch = Annotated[str | None, Header(alias="If-Match")]
    router = APIRouter(responses=ERRORS)

    @router.get("/models", summary="Models Triton knows, each version's state, and the routing policy")
    async def list_models(_: Actor) -> dict[str, Any]:
        return {"models": await policies.models()}

    @router.get("/models/{model}/policy", response_model=PolicyOut, summary="The model's policy; ETag = revision")
    async def get_policy(model: ModelName, response: Response, _: Actor) -> dict[str, Any]:
        return policy_response(await policies.get(model), response)

    @router.put("/models/{model}/policy", response_model=PolicyOut,
                summary="Replace the model's policy (every routed version must be READY on Triton)")
    async def put_policy(model: ModelName, spec: PolicySpec, response: Response, who: Actor,
                         if_match: IfMatch = None) -> dict[str, Any]:
        warnings = await effects.of_policy_change(policies.store, model, held(policies, model), spec)
        stored = await policies.put(model, spec, parse_if_match(if_match), EventDraft(who, "put_policy"))
        return policy_response(stored, response, warnings)

    @router.patch("/models/{model}/policy/weights", response_model=PolicyOut, summary="Change only the weights")
    async def patch_weights(model: ModelName, change: WeightsChange, response: Response, who: Actor,
                            if_match: IfMatch = None) -> dict[str, Any]:
        weights: dict[str, Decimal] = dict(change.weights)
        warnings = await effects.of_weights(policies.store, model, held(policies, model), weights)
        stored = await policies.set_weights(model, dict(weights), parse_if_match(if_match),
                                            EventDraft(who, "set_weights", change.reason))
        return policy_response(stored, response, warnings)

    @router.delete("/models/{model}/policy", summary="Remove the policy: requests go to Triton's default again")
    async def delete_policy(model: ModelName, who: Actor, if_match: IfMatch = None) -> dict[str, Any]:
        warnings = await effects.of_policy_change(policies.store, model, held(policies, model), None)
        stored = await policies.delete(model, parse_if_match(if_match), EventDraft(who, "delete_policy"))
        return {"model": model, "revision": stored.revision, "deleted": True, "warnings": warnings}

    @router.get("/events", summary="The audit trail, newest first")
    async def events(_: Actor, model: Annotated[ModelName | None, Query()] = None,
                     limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> dict[str, Any]:
        return {"events": [e.document() for e in await policies.events(model, limit)]}

    return router
