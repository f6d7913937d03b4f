"""The admin API in process (httpx on the ASGI app), with the real Triton behind it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.support import INFER_BODY, TOKEN, AdminClient, gateway_settings

pytestmark = pytest.mark.triton
POLICY = {"weights": {"2": 80, "3": 20}, "sticky_header": "x-user-id",
          "rules": [{"header": "x-canary", "equals": "always", "version": "3"}]}


@pytest.fixture
async def admin(triton: LocalTriton) -> AsyncIterator[AdminClient]:
    settings = gateway_settings(triton.http_url, store_url="memory://", admin_token=TOKEN,
                                admin_tokens={"alice": "alice-token-1", "robot": "robot-token-1"})
    async with AdminClient(settings) as client:
        yield client


async def routed_versions(admin: AdminClient, n: int = 200) -> set[str]:
    seen = set()
    for _ in range(n):
        response = await admin.http.post("/v2/models/qc/infer", content=INFER_BODY)
        assert response.status_code == 200
        seen.add(response.json()["model_version"])
    return seen


async def test_every_endpoint_requires_a_token(admin: AdminClient) -> None:
    """Each wrong token from a client of its own: five wrong tokens from one client lock it out
    (429 before any token is compared, tests/unit/test_token_throttle.py)."""
    import httpx

    schema = (await admin.request("GET", "/admin/openapi.json", token=None)).json()
    assert schema["paths"], "the OpenAPI document is served"
    clients = 0
    for path, operations in schema["paths"].items():
        concrete = path.replace("{model}", "qc")
        for method in operations:
            for token in (None, "wrong-token-123"):
                clients += 1
                transport = httpx.ASGITransport(app=admin.app, client=(f"198.18.{clients // 250}.{clients % 250}", 1))
                async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
                    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
                    response = await http.request(method.upper(), concrete, headers=headers, json={})
                assert response.status_code == 401, (method, path, token)
                assert "error" in response.json()


async def test_models_lists_versions_with_state_and_policy(admin: AdminClient) -> None:
    await admin.request("PUT", "/admin/models/qc/policy", json=POLICY)
    models = {m["name"]: m for m in (await admin.request("GET", "/admin/models")).json()["models"]}
    assert {v["version"]: v["state"] for v in models["qc"]["versions"]} == {"1": "READY", "2": "READY", "3": "READY"}
    assert models["qc"]["policy"]["weights"] == {"2": 80, "3": 20}
    assert models["tok"]["policy"] is None


async def test_put_get_and_the_data_path_follows_at_once(admin: AdminClient) -> None:
    put = await admin.request("PUT", "/admin/models/qc/policy", json={"weights": {"1": 100}})
    assert put.status_code == 200 and put.json()["revision"] == 1 and put.headers["etag"] == '"1"'
    assert await routed_versions(admin, 20) == {"1"}
    got = await admin.request("GET", "/admin/models/qc/policy")
    assert got.json()["weights"] == {"1": 100} and got.headers["etag"] == '"1"'
    assert got.json()["sticky_header"] is None and got.json()["rules"] == []


async def test_patch_weights_with_if_match(admin: AdminClient) -> None:
    await admin.request("PUT", "/admin/models/qc/policy", json=POLICY)
    ok = await admin.request("PATCH", "/admin/models/qc/policy/weights", headers={"If-Match": '"1"'},
                             json={"weights": {"2": 0, "3": 100}, "reason": "full canary"})
    assert ok.status_code == 200 and ok.json()["revision"] == 2
    assert ok.json()["rules"] == POLICY["rules"], "PATCH changes only the weights"
    assert await routed_versions(admin, 20) == {"3"}
    stale = await admin.request("PATCH", "/admin/models/qc/policy/weights", headers={"If-Match": '"1"'},
                                json={"weights": {"2": 100}})
    assert stale.status_code == 412 and "revision 2" in stale.json()["error"]
    assert (await admin.request("GET", "/admin/models/qc/policy")).json()["weights"] == {"2": 0, "3": 100}


async def test_concurrent_patches_with_the_same_if_match_have_one_winner(admin: AdminClient) -> None:
    await admin.request("PUT", "/admin/models/qc/policy", json=POLICY)
    responses = await asyncio.gather(*(
        admin.request("PATCH", "/admin/models/qc/policy/weights", headers={"If-Match": '"1"'},
                      json={"weights": {"2": 100 - i, "3": i}}) for i in range(20)))
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] + [412] * 19
    assert (await admin.request("GET", "/admin/models/qc/policy")).json()["revision"] == 2


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"weights": {"2": 70, "3": 20}}, 422, "sum to 100"),
    ({"weights": {"2": 79.999, "3": 20.001}}, 422, "decimal places"),
    ({"weights": {"2": -5, "3": 105}}, 422, "greater than or equal"),
    ({"weights": {"2": 100}, "surprise": True}, 422, "surprise"),
    ({"weights": {"two words": 100}}, 422, "neither a version nor a model name"),
    ({"weights": {"qc@02": 100}}, 422, "after '@' comes a version number"),
    ({"weights": {"two": 100}}, 409, "'two'"),
    ({"weights": {"7": 100}}, 409, "version 7 of model 'qc' is not known"),
    ({"weights": {"2": 100}, "rules": [{"header": "x-canary", "equals": "yes", "version": "9"}]}, 409, "version 9"),
    ([1, 2, 3], 422, "invalid request"),
])
async def test_invalid_policies_change_nothing(admin: AdminClient, body: object, status: int, message: str) -> None:
    await admin.request("PUT", "/admin/models/qc/policy", json=POLICY)
    response = await admin.request("PUT", "/admin/models/qc/policy", json=body)
    assert response.status_code == status and message in response.json()["error"]
    current = (await admin.request("GET", "/admin/models/qc/policy")).json()
    assert current["revision"] == 1 and current["weights"] == {"2": 80, "3": 20}
    assert len((await admin.request("GET", "/admin/events?model=qc")).json()["events"]) == 1


async def test_malformed_requests_are_4xx(admin: AdminClient) -> None:
    await admin.request("PUT", "/admin/models/qc/policy", json=POLICY)
    not_json = await admin.request("PUT", "/admin/models/qc/policy", content=b"{nope",
                                   headers={"content-type": "application/json"})
    assert not_json.status_code == 422
    bad_etag = await admin.request("PATCH", "/admin/models/qc/policy/weights", headers={"If-Match": "yesterday"},
                                   json={"weights": {"2": 100}})
    assert bad_etag.status_code == 400 and "If-Match" in bad_etag.json()["error"]
    huge = await admin.request("PUT", "/admin/models/qc/policy", content=b" " * 70_000,
                               headers={"content-type": "application/json"})
    assert huge.status_code == 413
    missing = await admin.request("PATCH", "/admin/models/tok/policy/weights", json={"weights": {"1": 100}})
    assert missing.status_code == 404 and "no routing policy" in missing.json()["error"]
    bad_name = await admin.request("GET", "/admin/models/bad%20name/policy")
    assert bad_name.status_code == 422
    assert (await admin.request("GET", "/admin/events?limit=0")).status_code == 422


async def test_delete_goes_back_to_passthrough(admin: AdminClient) -> None:
    await admin.request("PUT", "/admin/models/qc/policy", json={"weights": {"1": 100}})
    deleted = await admin.request("DELETE", "/admin/models/qc/policy")
    assert deleted.status_code == 200 and deleted.json()["revision"] == 2
    assert (await admin.request("GET", "/admin/models/qc/policy")).status_code == 404
    assert await routed_versions(admin, 5) == {"3"}, "Triton's own default: the highest READY version"
    assert (await admin.request("DELETE", "/admin/models/qc/policy")).status_code == 404


async def test_delete_checks_every_if_match_even_zero(admin: AdminClient) -> None:
    await admin.request("PUT", "/admin/models/qc/policy", json={"weights": {"1": 100}})
    for stale in ('"0"', '"2"'):
        refused = await admin.request("DELETE", "/admin/models/qc/policy", headers={"If-Match": stale})
        assert refused.status_code == 412 and "revision 1" in refused.json()["error"], stale
    assert (await admin.request("GET", "/admin/models/qc/policy")).json()["revision"] == 1, "nothing deleted"
    deleted = await admin.request("DELETE", "/admin/models/qc/policy", headers={"If-Match": '"1"'})
    assert deleted.status_code == 200 and deleted.json()["revision"] == 2


async def test_audit_trail_names_the_actor(admin: AdminClient) -> None:
    await admin.request("PUT", "/admin/models/qc/policy", json=POLICY, token="alice-token-1")
    await admin.request("PATCH", "/admin/models/qc/policy/weights", token="robot-token-1",
                        json={"weights": {"2": 90, "3": 10}, "reason": "nightly"})
    events = (await admin.request("GET", "/admin/events?model=qc&limit=10")).json()["events"]
    assert [(e["actor"], e["action"], e["model"]) for e in events] == [
        ("robot", "set_weights", "qc"), ("alice", "put_policy", "qc")]
    assert events[0]["reason"] == "nightly" and events[0]["before"]["weights"] == {"2": 80, "3": 20}
    assert events[0]["after"]["weights"] == {"2": 90, "3": 10} and isinstance(events[0]["at"], float)
    assert json.dumps(events)  # plain JSON all the way


async def test_admin_is_disabled_without_any_token(triton: LocalTriton) -> None:
    async with AdminClient(gateway_settings(triton.http_url, store_url="memory://")) as client:
        response = await client.request("GET", "/admin/models")
        assert response.status_code == 503 and "GATEWAY_ADMIN_TOKEN" in response.json()["error"]


async def test_insecure_admin_runs_without_a_token(triton: LocalTriton) -> None:
    settings = gateway_settings(triton.http_url, store_url="memory://", insecure_admin=True)
    async with AdminClient(settings) as client:
        assert (await client.request("PUT", "/admin/models/qc/policy", token=None, json=POLICY)).status_code == 200
        events = (await client.request("GET", "/admin/events", token=None)).json()["events"]
        assert events[0]["actor"] == "anonymous"


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", None, "text/plain"])
async def test_insecure_admin_reads_no_form_or_typeless_body(triton: LocalTriton, content_type: str | None) -> None:
    """Without a token to check, a body a cross-site page can send without asking (a form,
    text/plain, no type) is refused with 415 and changes nothing: read as JSON, one started a
    rollout from a page on another site. application/json (which needs a CORS preflight) is read."""
    settings = gateway_settings(triton.http_url, store_url="memory://", insecure_admin=True)
    body = json.dumps(POLICY).encode()
    async with AdminClient(settings) as client:
        headers = {} if content_type is None else {"Content-Type": content_type}
        refused = await client.request("PUT", "/admin/models/qc/policy", token=None, content=body, headers=headers)
        assert refused.status_code == 415 and "application/json" in refused.json()["error"], refused.text
        rollout = await client.request("POST", "/admin/models/qc/rollout", token=None, headers=headers,
                                       content=json.dumps({"canary": "3"}).encode())
        assert rollout.status_code == 415
        assert (await client.request("GET", "/admin/models/qc/policy", token=None)).status_code == 404
        assert (await client.request("GET", "/admin/models/qc/rollout", token=None)).status_code == 404
        typed = await client.request("PUT", "/admin/models/qc/policy", token=None, content=body,
                                     headers={"Content-Type": "application/json"})
        assert typed.status_code == 200
