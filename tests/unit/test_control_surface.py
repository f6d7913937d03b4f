"""Which data-port requests are Triton model control (pure classification, and the gate's three modes)."""

from __future__ import annotations

import asyncio

import pytest
from tritonclient.grpc import service_pb2

from gateway.control_surface import (
    ControlAction,
    ControlCall,
    ControlGate,
    ControlMode,
    grpc_control_call,
    http_control_call,
)
from gateway.errors import GatewayError, Unauthorized
from gateway.grpc.router import SERVICE as GRPC_SERVICE
from gateway.settings import Settings, SettingsError

CONTROL = [
    ("POST", "/v2/repository/models/tok/load", ControlAction.MODEL_LOAD, "tok"),
    ("POST", "/v2/repository/models/tok/unload", ControlAction.MODEL_UNLOAD, "tok"),
    ("POST", "/v2/repository/main/models/Tok/unload", ControlAction.MODEL_UNLOAD, "Tok"),
    ("POST", "//v2//repository/models/tok/unload/", ControlAction.MODEL_UNLOAD, "tok"),
    ("POST", "/v2/Repository/models/tok/UNLOAD", ControlAction.MODEL_UNLOAD, "tok"),
    ("GET", "/v2/repository/models/tok/unload", ControlAction.MODEL_UNLOAD, "tok"),
    ("POST", "/v2/repository/something/else", ControlAction.REPOSITORY, ""),
    ("POST", "/v2/systemsharedmemory/region/r/register", ControlAction.SHARED_MEMORY, ""),
    ("POST", "/v2/systemsharedmemory/region/r/unregister", ControlAction.SHARED_MEMORY, ""),
    ("POST", "/v2/systemsharedmemory/unregister", ControlAction.SHARED_MEMORY, ""),
    ("POST", "/v2/cudasharedmemory/region/r/register", ControlAction.SHARED_MEMORY, ""),
    ("POST", "/v2/cudasharedmemory/unregister", ControlAction.SHARED_MEMORY, ""),
    ("POST", "/v2/systemsharedmemory/status", ControlAction.SHARED_MEMORY, ""),
    ("POST", "/v2/trace/setting", ControlAction.TRACE_SETTING, ""),
    ("POST", "/v2/models/qc/trace/setting", ControlAction.TRACE_SETTING, "qc"),
    ("PUT", "/v2/trace/setting", ControlAction.TRACE_SETTING, ""),
    ("POST", "/v2/logging", ControlAction.LOG_SETTING, ""),
]
READ_ONLY = [
    ("POST", "/v2/repository/index"), ("POST", "/v2/repository/main/index"), ("GET", "/v2"),
    ("GET", "/v2/models/qc"), ("GET", "/v2/models/qc/config"), ("GET", "/v2/models/qc/stats"),
    ("GET", "/v2/models/qc/versions/2/ready"), ("GET", "/v2/health/ready"), ("GET", "/v2/health/live"),
    ("GET", "/v2/systemsharedmemory/status"), ("GET", "/v2/cudasharedmemory/region/r/status"),
    ("GET", "/v2/trace/setting"), ("GET", "/v2/models/qc/trace/setting"), ("GET", "/v2/logging"),
    ("POST", "/v2/models/qc/infer"), ("POST", "/metrics"),
]


@pytest.mark.parametrize(("method", "path", "action", "model"), CONTROL)
def test_control_calls_over_http_are_recognised(method: str, path: str, action: ControlAction, model: str) -> None:
    call = http_control_call(method, path)
    assert call is not None and call.action is action and call.model == model


@pytest.mark.parametrize(("method", "path"), READ_ONLY)
def test_read_only_calls_over_http_stay_open(method: str, path: str) -> None:
    assert http_control_call(method, path) is None


def test_refusals_name_what_to_use_instead() -> None:
    unload = http_control_call("POST", "/v2/repository/models/tok/unload")
    assert unload is not None and "POST /admin/models/tok/versions/{version}/unload" in unload.refusal()
    load = grpc_control_call(GRPC_SERVICE + "RepositoryModelLoad",
                             service_pb2.RepositoryModelLoadRequest(model_name="qc").SerializeToString())
    assert load is not None and "POST /admin/models/qc/versions/{version}/load" in load.refusal()
    shm = http_control_call("POST", "/v2/systemsharedmemory/region/r/register")
    assert shm is not None and "GATEWAY_TRITON_CONTROL=admin" in shm.refusal()


def _message(method: str, **fields: object) -> bytes:
    return getattr(service_pb2, method + "Request")(**fields).SerializeToString()  # type: ignore[no-any-return]


@pytest.mark.parametrize(("method", "message", "action"), [
    ("RepositoryModelUnload", _message("RepositoryModelUnload", model_name="tok"), ControlAction.MODEL_UNLOAD),
    ("RepositoryModelLoad", _message("RepositoryModelLoad", model_name="tok"), ControlAction.MODEL_LOAD),
    ("SystemSharedMemoryRegister", _message("SystemSharedMemoryRegister", name="r", key="/k", byte_size=8),
     ControlAction.SHARED_MEMORY),
    ("SystemSharedMemoryUnregister", b"", ControlAction.SHARED_MEMORY),
    ("CudaSharedMemoryRegister", _message("CudaSharedMemoryRegister", name="r"), ControlAction.SHARED_MEMORY),
    ("CudaSharedMemoryUnregister", b"", ControlAction.SHARED_MEMORY),
    ("TraceSetting", _message("TraceSetting", model_name="qc", settings={"trace_rate": {"value": ["1"]}}),
     ControlAction.TRACE_SETTING),
    ("LogSettings", _message("LogSettings", settings={"log_verbose_level": {"uint32_param": 1}}),
     ControlAction.LOG_SETTING),
    ("LogSettings", b"\xff\xff", ControlAction.LOG_SETTING),  # unreadable: treated as a change
])
def test_control_calls_over_grpc_are_recognised(method: str, message: bytes, action: ControlAction) -> None:
    call = grpc_control_call(GRPC_SERVICE + method, message)
    assert call is not None and call.action is action


@pytest.mark.parametrize(("method", "message"), [
    ("RepositoryIndex", b""), ("ModelMetadata", _message("ModelMetadata", name="qc")),
    ("ModelConfig", b""), ("ModelStatistics", b""), ("ServerLive", b""), ("SystemSharedMemoryStatus", b""),
    ("CudaSharedMemoryStatus", b""), ("TraceSetting", _message("TraceSetting", model_name="qc")),
    ("LogSettings", b""),
])
def test_read_only_calls_over_grpc_stay_open(method: str, message: bytes) -> None:
    assert grpc_control_call(GRPC_SERVICE + method, message) is None


def test_grpc_model_name_is_read_from_the_message() -> None:
    call = grpc_control_call(GRPC_SERVICE + "RepositoryModelUnload", _message("RepositoryModelUnload",
                                                                                model_name="tok"))
    assert call is not None and call.model == "tok" and "tok" in call.described


class _Audit:
    def __init__(self, fail: bool = False) -> None:
        self.lines: list[tuple[ControlCall, str, str]] = []
        self.fail = fail

    async def __call__(self, call: ControlCall, actor: str, protocol: str) -> None:
        if self.fail:
            raise GatewayError("store down")
        self.lines.append((call, actor, protocol))


def _actor(authorization: str | None, client: str = "", where: str = "") -> str:
    if authorization != "Bearer right-token":
        raise Unauthorized("invalid bearer token")
    return "sre"


UNLOAD = ControlCall(ControlAction.MODEL_UNLOAD, "POST /v2/repository/models/tok/unload", "tok")


def test_the_gate_in_each_mode() -> None:
    audit = _Audit()
    denied = asyncio.run(ControlGate(ControlMode.DENY, _actor, audit).admit(UNLOAD, "Bearer right-token", "http"))
    assert denied is not None and denied.status == 403 and "/admin/models/tok/versions" in denied.message
    admin = ControlGate(ControlMode.ADMIN, _actor, audit)
    refused = asyncio.run(admin.admit(UNLOAD, None, "http"))
    assert refused is not None and refused.status == 401 and not audit.lines
    assert asyncio.run(admin.admit(UNLOAD, "Bearer right-token", "grpc")) is None
    assert audit.lines == [(UNLOAD, "sre", "grpc")]
    assert asyncio.run(ControlGate(ControlMode.ALLOW, _actor, audit).admit(UNLOAD, None, "http")) is None


def test_no_audit_line_no_change() -> None:
    refused = asyncio.run(ControlGate(ControlMode.ADMIN, _actor, _Audit(fail=True)).admit(UNLOAD, "Bearer right-token",
                                                                                           "http"))
    assert refused is not None and refused.message == "store down"


def test_admin_mode_needs_a_token_to_check() -> None:
    with pytest.raises(SettingsError, match="triton_control=admin needs an admin token"):
        Settings.load(None, triton_control="admin")
    assert Settings.load(None, triton_control="admin", admin_token="long-enough").triton_control == "admin"
    assert Settings.load(None).triton_control == "deny"


@pytest.mark.parametrize(("path", "raw_path", "normalised"), [
    ("/v2/x/../repository/models/m/unload", None, "/v2/repository/models/m/unload"),  # the case
    ("/v2/repository/./models/tok/unload", None, "/v2/repository/models/tok/unload"),
    ("/v2/models/qc/../../repository/models/m/load", None, "/v2/repository/models/m/load"),
    ("/v2/../../../v2/logging", None, "/v2/logging"),
    ("/v2/health/ready/..", None, "/v2/health/"),
    ("/v2/x/../health/ready", None, "/v2/health/ready"),  # read-only once normalised: refused all the same
    # %2F decoded by the server: the decoded path is what a normalising hop would route
    ("/v2/repository/models/m/unload", b"/v2/repository%2Fmodels%2fm/unload", "/v2/repository/models/m/unload"),
    ("/v2/models/a/../../repository/models/m/unload", b"/v2/models/a%2F..%2F..%2Frepository/models/m/unload",
     "/v2/repository/models/m/unload"),
])
def test_paths_that_normalise_differently_are_refused(path: str, raw_path: bytes | None, normalised: str) -> None:
    call = http_control_call("POST", path, raw_path)
    assert call is not None and call.action is ControlAction.UNNORMALISED_PATH and call.model == normalised
    assert f"resolved: {normalised}" in call.refusal()
    audit = _Audit()
    for mode in (ControlMode.DENY, ControlMode.ADMIN):  # an admin token does not make it readable
        refused = asyncio.run(ControlGate(mode, _actor, audit).admit(call, "Bearer right-token", "http"))
        assert refused is not None and refused.status == 400 and "send the normalised path" in refused.message
    assert not audit.lines
    assert asyncio.run(ControlGate(ControlMode.ALLOW, _actor, audit).admit(call, None, "http")) is None


@pytest.mark.parametrize("path", ["/v2/models/qc/config", "/v2/repository/index", "/v2/models/.hidden/config",
                                  "/v2/models/a..b/ready"])
def test_paths_that_read_the_same_normalised_are_classified_as_before(path: str) -> None:
    assert http_control_call("GET", path, path.encode()) is None
