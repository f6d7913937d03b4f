"""Triton model control on the data ports, against the real Triton: refused by default, admitted
with an admin token and audited under ``triton_control=admin``."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.devtools.local_triton import LocalTriton
from tests.support import AUTH, TOKEN, GatewayThread, admin_call, gateway_settings, get_json, wait_for

pytestmark = pytest.mark.triton


def post(url: str, body: bytes = b"{}", headers: dict[str, str] | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=body, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def tok_ready(triton: LocalTriton) -> bool:
    return get_json(f"{triton.http_url}/v2/models/tok/ready")[0] == 200


@pytest.fixture
def tok_loaded_after(triton: LocalTriton) -> Iterator[None]:
    """Whatever a test does to ``tok``, the next test finds it loaded."""
    yield
    if not tok_ready(triton):
        post(f"{triton.http_url}/v2/repository/models/tok/load")
        wait_for(lambda: tok_ready(triton), 30, what="tok loaded again")


def grpc_stub(gateway: GatewayThread) -> tuple[grpc.Channel, service_pb2_grpc.GRPCInferenceServiceStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{gateway.settings.grpc_port}")
    return channel, service_pb2_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture(scope="module")
def denying(triton: LocalTriton) -> Iterator[GatewayThread]:
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, admin_token=TOKEN)
    assert settings.triton_control == "deny", "the default"
    with GatewayThread(settings) as running:
        yield running


def test_unload_over_http_is_refused_and_the_model_stays_loaded(denying: GatewayThread, triton: LocalTriton,
                                                                 tok_loaded_after: None) -> None:
    for headers in ({}, AUTH):  # denied outright: not even an admin token opens it
        status, body = post(f"{denying.url}/v2/repository/models/tok/unload", headers=headers)
        assert status == 403
        assert "POST /admin/models/tok/versions/{version}/unload" in body["error"]
    status, body = post(f"{denying.url}/v2/repository/models/tok/load",
                        json.dumps({"parameters": {"config": "{}"}}).encode())
    assert status == 403 and "POST /admin/models/tok/versions/{version}/load" in body["error"]
    assert tok_ready(triton)


def test_read_only_calls_stay_open(denying: GatewayThread) -> None:
    status, index = post(f"{denying.url}/v2/repository/index")
    assert status == 200 and {entry["name"] for entry in index} >= {"qc", "tok"}
    assert get_json(f"{denying.url}/v2/trace/setting")[0] == 200
    assert get_json(f"{denying.url}/v2/models/tok/config")[0] == 200


def test_settings_updates_and_shared_memory_are_refused(denying: GatewayThread) -> None:
    for path, body in [("/v2/logging", b'{"log_verbose_level": 1}'), ("/v2/trace/setting", b'{"trace_rate": "1"}'),
                       ("/v2/systemsharedmemory/region/r/register", b'{"key": "/k", "offset": 0, "byte_size": 8}')]:
        status, answer = post(denying.url + path, body)
        assert status == 403 and "GATEWAY_TRITON_CONTROL=admin" in answer["error"], path


@pytest.mark.parametrize("server", ["lean", "grpcio"])
def test_unload_over_grpc_is_refused_and_the_model_stays_loaded(triton: LocalTriton, server: str,
                                                                tok_loaded_after: None) -> None:
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, grpc_server=server)
    with GatewayThread(settings) as gateway:
        channel, client = grpc_stub(gateway)
        with pytest.raises(grpc.RpcError) as caught:
            client.RepositoryModelUnload(service_pb2.RepositoryModelUnloadRequest(model_name="tok"), timeout=10)
        assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "POST /admin/models/tok/versions/{version}/unload" in (caught.value.details() or "")
        with pytest.raises(grpc.RpcError) as caught:
            client.LogSettings(service_pb2.LogSettingsRequest(settings={"log_verbose_level": {"uint32_param": 1}}),
                               timeout=10)
        assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert client.LogSettings(service_pb2.LogSettingsRequest(), timeout=10).settings  # reading stays open
        assert len(client.RepositoryIndex(service_pb2.RepositoryIndexRequest(), timeout=10).models) >= 2
        channel.close()
    assert tok_ready(triton)


@pytest.fixture(scope="module")
def admitting(triton: LocalTriton) -> Iterator[GatewayThread]:
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, admin_token=TOKEN,
                                triton_control="admin")
    with GatewayThread(settings) as running:
        yield running


def events(gateway: GatewayThread, protocol: str) -> list[dict[str, Any]]:
    """The audit lines of control calls that came through one protocol's data port."""
    status, body = admin_call(gateway.url, "GET", "/admin/events?model=tok")
    assert status == 200
    return [event for event in body["events"]
            if event["action"].startswith("triton_") and f"through the {protocol} data port" in event["reason"]]


def test_admin_mode_needs_the_token_and_audits_the_call(admitting: GatewayThread, triton: LocalTriton,
                                                        tok_loaded_after: None) -> None:
    status, body = post(f"{admitting.url}/v2/repository/models/tok/unload",
                        headers={"Authorization": "Bearer wrong-token"})
    assert status == 401 and "admin bearer token" in body["error"]
    assert tok_ready(triton) and events(admitting, "http") == []

    assert post(f"{admitting.url}/v2/repository/models/tok/unload", headers=AUTH) == (200, None)
    wait_for(lambda: not tok_ready(triton), 30, what="tok unloaded")
    assert post(f"{admitting.url}/v2/repository/models/tok/load", headers=AUTH) == (200, None)
    assert tok_ready(triton)
    audit = events(admitting, "http")
    assert [(e["action"], e["actor"]) for e in audit] == [("triton_model_load", "admin"),
                                                          ("triton_model_unload", "admin")]  # newest first


def test_admin_mode_over_grpc(admitting: GatewayThread, triton: LocalTriton, tok_loaded_after: None) -> None:
    channel, client = grpc_stub(admitting)
    unload = service_pb2.RepositoryModelUnloadRequest(model_name="tok")
    with pytest.raises(grpc.RpcError) as caught:
        client.RepositoryModelUnload(unload, timeout=10)
    assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert tok_ready(triton) and events(admitting, "grpc") == []

    client.RepositoryModelUnload(unload, metadata=[("authorization", f"Bearer {TOKEN}")], timeout=30)
    wait_for(lambda: not tok_ready(triton), 30, what="tok unloaded")
    client.RepositoryModelLoad(service_pb2.RepositoryModelLoadRequest(model_name="tok"),
                               metadata=[("authorization", f"Bearer {TOKEN}")], timeout=30)
    assert tok_ready(triton)
    audit = events(admitting, "grpc")
    assert [(e["action"], e["actor"]) for e in audit] == [("triton_model_load", "admin"),
                                                          ("triton_model_unload", "admin")]
    channel.close()


@pytest.mark.parametrize("server", ["lean", "grpcio"])
def test_wrong_control_tokens_on_the_data_ports_share_the_count(triton: LocalTriton, server: str) -> None:
    """The gRPC metadata token took unlimited guesses; it counts with the HTTP port's (and the
    admin API's): past the free tries the client waits (429, RESOURCE_EXHAUSTED) and Triton is
    never asked, the right token included."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, admin_token=TOKEN,
                                triton_control="admin", grpc_server=server)
    with GatewayThread(settings) as gateway:
        channel, client = grpc_stub(gateway)
        unload = service_pb2.RepositoryModelUnloadRequest(model_name="tok")
        codes = []
        for n in range(5):
            try:
                client.RepositoryModelUnload(unload, metadata=[("authorization", f"Bearer guess-{n}-xx")], timeout=10)
            except grpc.RpcError as exc:
                codes.append(exc.code())
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 5
        status, _ = post(f"{gateway.url}/v2/repository/models/tok/unload", headers={"Authorization": "Bearer guess-h"})
        assert status == 401  # the sixth wrong token, on the HTTP port
        with pytest.raises(grpc.RpcError) as caught:
            client.RepositoryModelUnload(unload, metadata=[("authorization", f"Bearer {TOKEN}")], timeout=10)
        assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "too many wrong tokens" in (caught.value.details() or "")
        assert post(f"{gateway.url}/v2/repository/models/tok/unload", headers=AUTH)[0] == 429
        audited = gateway.call(gateway.app.store.events("tok"))  # read inside: this client is locked out of /admin
        assert tok_ready(triton) and not [e for e in audited if e.action.startswith("triton_")]
        channel.close()
