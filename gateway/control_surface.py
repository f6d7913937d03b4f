"""Which requests on the data ports would change Triton itself, and what the gateway does with them.

Triton serves model-repository control (load, unload), shared-memory (un)registration and
trace / log setting updates on the same ports as inference. Passed through, anyone who can
send an inference could unload every model or load one with a config override, and no audit
line would say so. The gateway's own admin API does the same things safely (drain before
unload, READY checks, audit trail), so on the data ports these calls are, per
``triton_control``:

- ``deny`` (the default): refused, HTTP 403 / gRPC PERMISSION_DENIED, naming what to use instead;
- ``admin``: passed through only with an admin bearer token (``Authorization`` header or gRPC
  ``authorization`` metadata), and written to the audit trail first;
- ``allow``: passed through, as Triton itself would.

Read-only calls stay open: repository index, metadata, config, statistics, health, shared-memory
status, and reading the trace and log settings.

Classification is by namespace, then by the few read-only calls inside it: anything else under
``/v2/repository``, ``/v2/systemsharedmemory`` or ``/v2/cudasharedmemory`` counts as control,
so an unusual spelling of a path (``//``, a trailing ``/``, an upper-case segment, a path
Triton would not know) is refused rather than let through. The decision is made on the path
with its percent-encoding and dot segments resolved (``/v2/x/../repository/...`` is the
repository's), and a path that reads differently once so normalised (a ``.`` or ``..``
segment, an encoded ``/``) is refused with 400 in ``deny`` and ``admin`` modes: Triton does not
normalise paths, but a normalising hop in front of it would. This module is pure; the data
plane calls it only for requests it does not route (never for an inference).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from gateway.errors import BadRequest, Forbidden, GatewayError, TooManyAttempts, Unauthorized
from gateway.grpc.router import SERVICE as GRPC_SERVICE
from gateway.grpc.status import status_for
from gateway.grpc.wire import WireError, top_level_field

ADMIN_LOAD = "POST /admin/models/{model}/versions/{{version}}/load on the gateway's admin API"
ADMIN_UNLOAD = "POST /admin/models/{model}/versions/{{version}}/unload on the gateway's admin API (drains first)"
_ON_TRITON = ("Triton's own port (this changes one Triton server, not the gateway), or set "
              "GATEWAY_TRITON_CONTROL=admin and send an admin bearer token")


class ControlMode(StrEnum):
    DENY = "deny"
    ADMIN = "admin"
    ALLOW = "allow"


class ControlAction(StrEnum):
    """The audit trail's action names for control calls that came through a data port."""

    MODEL_LOAD = "triton_model_load"
    MODEL_UNLOAD = "triton_model_unload"
    REPOSITORY = "triton_repository_control"
    SHARED_MEMORY = "triton_shared_memory"
    TRACE_SETTING = "triton_trace_setting"
    LOG_SETTING = "triton_log_setting"
    UNNORMALISED_PATH = "unnormalised_path"  # never forwarded, never audited: refused as a bad request


@dataclass(frozen=True, slots=True)
class ControlCall:
    action: ControlAction
    described: str  # what the client asked for, e.g. "POST /v2/repository/models/tok/unload"
    model: str = ""  # "" for calls that are not about one model

    @property
    def instead(self) -> str:
        model = self.model or "{model}"
        if self.action is ControlAction.MODEL_LOAD:
            return ADMIN_LOAD.format(model=model)
        if self.action is ControlAction.MODEL_UNLOAD:
            return ADMIN_UNLOAD.format(model=model)
        return _ON_TRITON

    def refusal(self) -> str:
        if self.action is ControlAction.UNNORMALISED_PATH:
            return (f"{self.described[:300]} reads differently once normalised (dot segments and encoded '/' "
                    f"resolved: {self.model[:300]}); send the normalised path")
        return (f"{self.described} changes Triton and is refused on the gateway's data port "
                f"(GATEWAY_TRITON_CONTROL=deny): use {self.instead}")


_REPOSITORY, _SYSTEM_SHM, _CUDA_SHM = "repository", "systemsharedmemory", "cudasharedmemory"
_READ_METHODS = frozenset(["GET", "HEAD"])


def http_control_call(method: str, path: str, raw_path: bytes | None = None) -> ControlCall | None:
    """The control call an HTTP request on ``/v2/...`` makes, or None for everything else.
    ``path`` is percent-decoded; ``raw_path`` as sent (an encoded ``/`` shows only there)."""
    segments = path.split("/")
    if "." in segments or ".." in segments or raw_path is not None and b"%2f" in raw_path.lower():
        # the normalised path rides in ``model``: the refusal names it
        return ControlCall(ControlAction.UNNORMALISED_PATH, f"{method} {path}", normalised(path))
    parts = [part.lower() for part in segments if part]
    if len(parts) < 2 or parts[0] != "v2":
        return None
    described = f"{method} {path}"
    namespace, last = parts[1], parts[-1]
    if namespace == _REPOSITORY:
        if last == "index" and len(parts) <= 4:  # /v2/repository[/{repo}]/index
            return None
        model = parts[-2] if len(parts) >= 5 and parts[-3] == "models" else ""
        if last == "load":
            return ControlCall(ControlAction.MODEL_LOAD, described, _original(path, model))
        if last == "unload":
            return ControlCall(ControlAction.MODEL_UNLOAD, described, _original(path, model))
        return ControlCall(ControlAction.REPOSITORY, described)
    if namespace in (_SYSTEM_SHM, _CUDA_SHM):
        if last == "status" and method in _READ_METHODS:
            return None
        return ControlCall(ControlAction.SHARED_MEMORY, described)
    if method in _READ_METHODS:
        return None
    if namespace == "logging":
        return ControlCall(ControlAction.LOG_SETTING, described)
    if parts[-2:] == ["trace", "setting"]:
        model = parts[2] if len(parts) > 4 and namespace == "models" else ""
        return ControlCall(ControlAction.TRACE_SETTING, described, _original(path, model))
    return None


def normalised(path: str) -> str:
    """``path`` with its dot segments resolved (RFC 3986 5.2.4)."""
    kept: list[str] = []
    for segment in path.split("/")[1:]:
        if segment == "..":
            if kept:
                kept.pop()
        elif segment != ".":
            kept.append(segment)
    if path.endswith(("/.", "/..")):
        kept.append("")
    return "/" + "/".join(kept)


def _original(path: str, lowered: str) -> str:
    """The model name as the client spelled it (the classification compared lower case)."""
    if not lowered:
        return ""
    for part in path.split("/"):
        if part.lower() == lowered:
            return part
    return lowered


_GRPC_ALWAYS = {
    GRPC_SERVICE + "RepositoryModelLoad": ControlAction.MODEL_LOAD,
    GRPC_SERVICE + "RepositoryModelUnload": ControlAction.MODEL_UNLOAD,
    GRPC_SERVICE + "SystemSharedMemoryRegister": ControlAction.SHARED_MEMORY,
    GRPC_SERVICE + "SystemSharedMemoryUnregister": ControlAction.SHARED_MEMORY,
    GRPC_SERVICE + "CudaSharedMemoryRegister": ControlAction.SHARED_MEMORY,
    GRPC_SERVICE + "CudaSharedMemoryUnregister": ControlAction.SHARED_MEMORY,
}
# TraceSetting and LogSettings read the settings when the request's `settings` map (field 1)
# is empty and change them otherwise.
_GRPC_SETTINGS = {
    GRPC_SERVICE + "TraceSetting": ControlAction.TRACE_SETTING,
    GRPC_SERVICE + "LogSettings": ControlAction.LOG_SETTING,
}
_MODEL_NAME_FIELD = {ControlAction.MODEL_LOAD: 2, ControlAction.MODEL_UNLOAD: 2, ControlAction.TRACE_SETTING: 2}


def grpc_control_call(path: str, message: bytes) -> ControlCall | None:
    """The control call a gRPC request makes (``path`` is ``/package.Service/Method``), or None."""
    action = _GRPC_ALWAYS.get(path)
    try:
        if action is None:
            action = _GRPC_SETTINGS.get(path)
            if action is None or top_level_field(message, 1) is None:
                return None
        number = _MODEL_NAME_FIELD.get(action)
        name = top_level_field(message, number) if number else None
    except WireError:
        return ControlCall(action or ControlAction.REPOSITORY, path.rpartition("/")[2])  # unreadable: control
    model = name.decode(errors="replace") if name else ""
    return ControlCall(action, path.rpartition("/")[2] + (f" of model '{model}'" if model else ""), model)


Metadata = Sequence[tuple[str | bytes, str | bytes]]


def _authorization(metadata: Metadata) -> str | None:
    for key, value in metadata:
        if key in ("authorization", b"authorization"):
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


Auditor = Callable[[ControlCall, str, str], Awaitable[None]]  # (call, actor, protocol)


class ControlGate:
    """``triton_control`` applied to one control call; built by the composition root.

    ``actor`` turns an ``Authorization`` value into an admin actor name or raises a
    :class:`GatewayError`; ``audit`` writes the audit line (and raises if it cannot).
    """

    def __init__(self, mode: ControlMode, actor: Callable[[str | None, str, str], str], audit: Auditor) -> None:
        self.mode = mode
        self._actor = actor
        self._audit = audit

    async def admit(self, call: ControlCall, authorization: str | None, protocol: str,
                    client: str = "") -> GatewayError | None:
        """None: forward the call. Otherwise the refusal to answer with (nothing was forwarded).
        A wrong token counts against ``client`` (``gateway.admin.throttle``)."""
        if self.mode is ControlMode.ALLOW:
            return None
        if call.action is ControlAction.UNNORMALISED_PATH:
            return BadRequest(call.refusal())
        if self.mode is ControlMode.DENY:
            return Forbidden(call.refusal())
        try:
            actor = self._actor(authorization, client, f"Triton control on the {protocol} data port")
        except TooManyAttempts as exc:
            return exc
        except Unauthorized as exc:
            return Unauthorized(f"{call.described} changes Triton and needs an admin bearer token on the data port "
                                f"(GATEWAY_TRITON_CONTROL=admin): {exc.message}")
        except GatewayError as exc:
            return Forbidden(f"{call.described} is refused: {exc.message}")
        try:
            await self._audit(call, actor, protocol)
        except GatewayError as exc:  # no audit line, no change
            return exc
        return None

    async def admit_grpc(self, path: str, message: bytes, metadata: Metadata,
                         client: str = "") -> tuple[int, str, Metadata]:
        """``(0, "", metadata to forward)`` to go on, else ``(status code, details, ())`` to answer with."""
        call = grpc_control_call(path, message)
        if call is None:
            return 0, "", metadata
        refused = await self.admit(call, _authorization(metadata), "grpc", client)
        if refused is not None:
            return status_for(refused), refused.message, ()
        return 0, "", tuple((k, v) for k, v in metadata if k not in ("authorization", b"authorization"))
