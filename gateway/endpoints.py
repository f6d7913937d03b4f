"""The control app's own endpoints and its error mapping: liveness, readiness, ``/metrics``,
and the one place exceptions become ``{"error": ...}`` responses."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from gateway.errors import GatewayError
from gateway.metrics_port import MetricsAccess, guarded
from gateway.policy_book import PolicyBook
from gateway.telemetry.exposition import SnapshotRegistry

Live = Callable[[float], Awaitable["str | None"]]  # Fleet.live: None, or why no Triton is live


class Probes:
    """``/healthz`` (the process answers), ``/readyz`` (policies loaded, their sync not failing
    for too long, and a Triton of the default fleet live), ``/metrics``. The gRPC health service
    answers from the same :meth:`problem`."""

    def __init__(self, live: Live, book: PolicyBook, registry: SnapshotRegistry,
                 timeout_s: float, sync_problem: Callable[[], str | None] = lambda: None,
                 access: MetricsAccess | None = None) -> None:
        self.sync_problem = sync_problem  # why policy sync makes this replica unready, if it does
        self.live = live
        self.book = book
        self.registry = registry
        self.timeout_s = timeout_s
        self.access = access or MetricsAccess(None, None)  # metrics_token, metrics_port (gateway.metrics_port)
        self.started = False  # set by the lifespan once the policies are loaded

    def router(self) -> APIRouter:
        router = APIRouter(include_in_schema=False)
        router.add_api_route("/healthz", self.healthz, methods=["GET"])
        router.add_api_route("/readyz", self.readyz, methods=["GET"])
        router.add_api_route("/metrics", guarded(self.access, self.metrics, on_own_port=False), methods=["GET"])
        return router

    async def metrics(self, request: Request) -> Response:
        """Copied on this loop, rendered on the registry's thread (gateway.telemetry.exposition)."""
        body, content_type = await self.registry.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    async def healthz(self) -> dict[str, str]:
        return {"status": "alive"}

    async def problem(self) -> str | None:
        """Why this replica is not ready, or None. Triton is asked over each server's probe
        connection (``Fleet.live``): a saturated server answers at once, admission never queues it."""
        if not self.started:
            return "gateway is starting: policies not loaded yet"
        problem = self.sync_problem()
        if problem is not None:
            return problem
        return await self.live(self.timeout_s)

    async def readyz(self) -> JSONResponse:
        problem = await self.problem()
        if problem is not None:
            return JSONResponse({"error": problem}, status_code=503)
        return JSONResponse({"status": "ready", "policies": sorted(self.book.snapshot())})


def install_error_handlers(app: FastAPI) -> None:
    """Every error the control app answers has Triton's shape: ``{"error": "..."}``."""
    app.add_exception_handler(GatewayError, _gateway_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid_request)  # type: ignore[arg-type]
    app.add_exception_handler(ValidationError, _invalid_request)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]


async def _gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
    return JSONResponse({"error": exc.message}, status_code=exc.status,
                        headers={name.decode(): value.decode() for name, value in exc.headers})


async def _invalid_request(_: Request, exc: RequestValidationError | ValidationError) -> JSONResponse:
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        problems.append(f"{where}: {err.get('msg')}")
    return JSONResponse({"error": "invalid request: " + "; ".join(problems)}, status_code=422)


async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
    return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)
