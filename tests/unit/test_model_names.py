"""'.' and '..' are directories of a model repository, never models: refused wherever a model
name is taken (the admin API, the console's actions, the config's policies, both data ports)."""

from __future__ import annotations

import httpx
import pytest

from gateway.app import Gateway
from gateway.errors import BadRequest
from gateway.pipeline import checked_model
from gateway.settings import Settings, SettingsError

TOKEN = "operator-token-1"


def gateway() -> Gateway:
    return Gateway(Settings.load(None, triton_url="http://127.0.0.1:9", store_url="memory://",
                                 admin_tokens={"alice": TOKEN}))


@pytest.mark.parametrize("name", [".", ".."])
def test_the_data_ports_refuse_dot_segments_as_model_names(name: str) -> None:
    with pytest.raises(BadRequest, match="not a model name"):
        checked_model(name)
    assert checked_model("...") == "..."  # a directory name like any other


@pytest.mark.parametrize("encoded", ["%2E", "%2E%2E"])
async def test_an_inference_to_a_dot_model_is_answered_400_and_never_forwarded(encoded: str) -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway()), base_url="http://gw") as http:
        answer = await http.post(f"/v2/models/{encoded}/infer", content=b"{}")
    assert answer.status_code == 400 and "not a model name" in answer.json()["error"]


@pytest.mark.parametrize("encoded", ["%2E", "%2E%2E"])
async def test_the_admin_api_refuses_dot_model_names(encoded: str) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway()), base_url="http://gw") as http:
        put = await http.put(f"/admin/models/{encoded}/policy", json={"weights": {"1": 100}}, headers=headers)
        load = await http.post(f"/admin/models/{encoded}/versions/1/load", headers=headers)
        rollout = await http.post(f"/admin/models/{encoded}/rollout", json={"canary": "2"}, headers=headers)
    for answer in (put, load, rollout):
        assert answer.status_code == 422 and "not a model name" in answer.json()["error"], answer.text


def test_the_config_refuses_a_policy_for_a_dot_model() -> None:
    with pytest.raises(SettingsError, match="not a model name"):
        Settings.load(None, store_url="memory://", policies={"..": {"weights": {"1": 100}}})
