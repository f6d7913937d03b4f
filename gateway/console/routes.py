"""The console's HTTP surface under /console: the page, its static files, login/logout, the
pages' JSON, and the operator actions.

Actions call the very services the admin API calls (PolicyService.set_weights,
RolloutController.begin/command, ModelLifecycle.load/unload) with the same request models, so
there is no second code path; the actor in the audit trail is the login's name with
``(via: console)``. Every state-changing request passes :func:`guard.change_allowed`.
"""

# No `from __future__ import annotations`: FastAPI resolves these annotations at runtime.
import logging
from enum import Enum
from typing import Annotated, Any

from fastapi import APIRouter, Body, FastAPI, Path, Query, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.admin.api import WeightsChange, held
from gateway.admin.auth import Authenticator
from gateway.admin.deps import ModelName, request_client
from gateway.console import guard
from gateway.console.assets import IMMUTABLE, Assets
from gateway.console.sessions import Sessions
from gateway.console.views import ModelNotFound, Views, console_actor
from gateway.errors import Forbidden, NotFound
from gateway.policy import Version
from gateway.rollout import effects
from gateway.rollout.spec import RolloutSpec
from gateway.services.lifecycle import ModelLifecycle
from gateway.store.base import EventDraft

log = logging.getLogger("gateway.console")
AnyModel = Annotated[str, Path(min_length=1, max_length=512)]  # reading: any name the store or Triton holds


class Login(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token: str = Field(max_length=4096)


class Command(str, Enum):
    promote = "promote"
    pause = "pause"
    resume = "resume"
    abort = "abort"
    retry = "retry"  # a new rollout with the last one's spec and "retry": true
    acknowledge = "acknowledge"  # a finished rollback was seen: it leaves "Needs attention"


class Preview(BaseModel):
    """What the confirmation dialog asks about: an action and the body it would send."""

    model_config = ConfigDict(extra="forbid")
    action: Annotated[str, Field(pattern=r"^(weights|start|promote|pause|resume|abort|retry|acknowledge)$")]
    body: dict[str, Any] = Field(default_factory=dict)


class VersionAction(str, Enum):
    load = "load"
    unload = "unload"


def install_console(app: FastAPI, views: Views, lifecycle: ModelLifecycle, auth: Authenticator,
                    sessions: Sessions) -> None:
    """The console's routes on the control app (so whatever serves /admin serves /console too: the
    HTTP port, or the control plane behind ``--workers``), and its security headers."""
    app.include_router(console_router(views, lifecycle, auth, sessions))
    app.add_middleware(guard.SecureHeaders)


def console_router(views: Views, lifecycle: ModelLifecycle, auth: Authenticator, sessions: Sessions) -> APIRouter:
    app = APIRouter(include_in_schema=False)  # not part of the admin API's OpenAPI document
    assets = Assets()

    # -- the page and its files ---------------------------------------------------------------
    @app.get("/console")
    @app.get("/console/")
    async def page() -> HTMLResponse:
        return HTMLResponse(assets.page, headers={"Cache-Control": "no-store"})

    @app.get("/console/static/{name:path}")
    async def static(name: str) -> Response:
        asset = assets.files.get(name)
        if asset is None:
            raise NotFound(f"no console file {name!r}")
        return Response(asset.body, media_type=asset.content_type, headers={"Cache-Control": IMMUTABLE})

    # -- login -----------------------------------------------------------------------------------
    @app.post("/console/login")
    async def login(request: Request, body: Login) -> JSONResponse:
        guard.same_origin(request)
        # 429 while this client is locked out for wrong tokens here or anywhere else (the token is
        # not even compared); a wrong one counts and is logged at the first and at each lockout
        who = auth.token_identity(body.token.strip(), request_client(request), "the console")
        session = sessions.open(who)
        log.info("console login: %s (%s)", who.name, who.role)
        response = JSONResponse(_session(session.who.name, session.who.role, session.csrf, views))
        guard.set_cookie(response, request, session, sessions.ttl_s)
        return _no_store(response)

    @app.post("/console/logout")
    async def logout(request: Request) -> JSONResponse:
        guard.same_origin(request)
        session = guard.session_of(request, sessions)
        if not session.csrf_matches(request.headers.get(guard.CSRF_HEADER)):
            raise Forbidden("missing or wrong CSRF token (X-CSRF-Token): reload the console")
        sessions.close(session.id)
        log.info("console logout: %s", session.who.name)
        response = JSONResponse({"logged_out": True})
        guard.clear_cookie(response, request)
        return _no_store(response)

    # -- what the pages read -------------------------------------------------------------------
    @app.get("/console/api/session")
    async def whoami(request: Request) -> JSONResponse:
        session = sessions.get(guard.session_cookie(request))
        if session is None:  # not an error: the page asks once to know whether to show the login form
            return _no_store(JSONResponse({"actor": None, "role": None, "csrf": None}))
        return _no_store(JSONResponse(_session(session.who.name, session.who.role, session.csrf, views)))

    @app.get("/console/api/overview")
    async def overview(request: Request) -> JSONResponse:
        guard.session_of(request, sessions)
        return _no_store(JSONResponse(await views.overview()))

    @app.get("/console/api/models/{model}")
    async def model_page(request: Request, model: AnyModel) -> JSONResponse:
        guard.session_of(request, sessions)
        try:
            return _no_store(JSONResponse(await views.model(model)))
        except ModelNotFound as exc:  # the page draws "not found", with no action on it
            return _no_store(JSONResponse({"error": exc.message, "not_found": True, "known": exc.known},
                                          status_code=404))

    @app.get("/console/api/models/{model}/versions/{version}")
    async def version_page(request: Request, model: AnyModel, version: Version,
                           against: Annotated[str | None, Query(max_length=300)] = None) -> JSONResponse:
        guard.session_of(request, sessions)
        try:
            return _no_store(JSONResponse(await views.version(model, version, against)))
        except ModelNotFound as exc:
            return _no_store(JSONResponse({"error": exc.message, "not_found": True, "known": exc.known},
                                          status_code=404))

    @app.get("/console/api/fleets")
    async def fleets(request: Request) -> JSONResponse:
        guard.session_of(request, sessions)
        return _no_store(JSONResponse(views.fleet_page()))

    @app.get("/console/api/audit")
    async def audit(request: Request, model: Annotated[str | None, Query(max_length=512)] = None,
                    actor: Annotated[str | None, Query(max_length=512)] = None,
                    action: Annotated[str | None, Query(max_length=128)] = None,
                    page: Annotated[int, Query(ge=0, le=1000)] = 0) -> JSONResponse:
        guard.session_of(request, sessions)
        return _no_store(JSONResponse(await views.audit(model, actor, action, page)))

    # -- operator actions: the admin API's service calls ------------------------------------------
    @app.post("/console/api/models/{model}/preview")
    async def preview(request: Request, model: ModelName, asked: Preview) -> JSONResponse:
        """What an action would do beyond what it names, for its confirmation (nothing changes)."""
        guard.session_of(request, sessions)
        store = views.rollouts.store
        if asked.action == "weights":
            try:
                change = WeightsChange.model_validate(asked.body)
            except ValidationError as exc:
                return invalid(exc)
            warnings = await effects.of_weights(store, model, held(views.policies, model), dict(change.weights))
        elif asked.action == "start":
            try:
                spec = RolloutSpec.model_validate(asked.body)
            except ValidationError as exc:
                return invalid(exc)
            warnings = await effects.of_start(store, model, spec)
        elif asked.action == "retry":
            stored = await store.get_rollout(model)
            warnings = [] if stored is None else await effects.of_start(
                store, model, RolloutSpec.model_validate({**stored.document["spec"], "retry": True}))
        else:
            warnings = await effects.of_command(store, model, asked.action)
        return _no_store(JSONResponse({"warnings": warnings}))

    @app.post("/console/api/models/{model}/weights")
    async def set_weights(request: Request, model: ModelName, change: WeightsChange) -> JSONResponse:
        who = console_actor(guard.change_allowed(request, sessions).who.name)
        warnings = await effects.of_weights(views.rollouts.store, model, held(views.policies, model),
                                           dict(change.weights))
        stored = await views.policies.set_weights(model, dict(change.weights), None,
                                                  EventDraft(who, "set_weights", change.reason))
        return _no_store(JSONResponse({**stored.document(), "warnings": warnings}))

    @app.post("/console/api/models/{model}/rollout")
    async def start_rollout(request: Request, model: ModelName,
                            body: Annotated[dict[str, Any], Body()]) -> JSONResponse:
        who = console_actor(guard.change_allowed(request, sessions).who.name)
        try:
            spec = RolloutSpec.model_validate(body)
        except ValidationError as exc:
            return invalid(exc)  # the API's 422 message, with the fields named for the form
        warnings = await effects.of_start(views.rollouts.store, model, spec)
        await views.rollouts.begin(model, spec, who)
        return _no_store(JSONResponse({**await views.rollouts.status(model), "warnings": warnings}))

    @app.post("/console/api/models/{model}/rollout/{command}")
    async def rollout_command(request: Request, model: ModelName, command: Command) -> JSONResponse:
        who = console_actor(guard.change_allowed(request, sessions).who.name)
        warnings: list[str] = []
        if command is Command.retry:
            stored = await views.rollouts.store.get_rollout(model)
            if stored is None:
                raise NotFound(f"model '{model}' has no rollout to retry")
            spec = RolloutSpec.model_validate({**stored.document["spec"], "retry": True})
            warnings = await effects.of_start(views.rollouts.store, model, spec)
            await views.rollouts.begin(model, spec, who)
        elif command is Command.acknowledge:
            await views.rollouts.acknowledge(model, who)
        else:
            warnings = await effects.of_command(views.rollouts.store, model, command.value)
            await views.rollouts.command(model, command.value, who)
        return _no_store(JSONResponse({**await views.rollouts.status(model), "warnings": warnings}))

    @app.post("/console/api/models/{model}/versions/{version}/{action}")
    async def version_action(request: Request, model: ModelName, version: Version,
                             action: VersionAction) -> JSONResponse:
        who = console_actor(guard.change_allowed(request, sessions).who.name)
        if action is VersionAction.load:
            return _no_store(JSONResponse(await lifecycle.load(model, version, who)))
        return _no_store(JSONResponse(await lifecycle.unload(model, version, who)))

    return app


def _session(name: str, role: str, csrf: str, views: Views) -> dict[str, Any]:
    return {"actor": name, "role": role, "csrf": csrf, "rates_from": views.rates_from()}


def _no_store(response: JSONResponse) -> JSONResponse:
    response.headers["Cache-Control"] = "no-store"
    return response


def invalid(exc: ValidationError) -> JSONResponse:
    """The admin API's 422 message, and each problem by field so the page can show it beside its input."""
    problems: list[str] = []
    fields: dict[str, Any] = {}
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        problems.append(f"{where}: {err.get('msg')}")
        fields.setdefault(where.split(".")[0], err.get("msg"))
    return JSONResponse({"error": "invalid request: " + "; ".join(problems), "fields": fields}, status_code=422)
