"""``/metrics`` behind ``metrics_token`` and/or on ``metrics_port`` (issue 32): open on the data
port, it named the version that answered each request (counters before and after matched 8 of
8), undoing ``expose_version_headers: false``, and showed Triton's addresses."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from gateway.devtools.local_triton import LocalTriton, free_port
from gateway.settings import Settings, SettingsError
from tests.support import INFER_BODY, GatewayThread, gateway_settings

pytestmark = pytest.mark.triton
METRICS_TOKEN = "scrape-token-1"


def scrape(url: str, token: str | None = None) -> tuple[int, str, dict[str, str]]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/metrics", headers=headers), timeout=10) as answer:
            return answer.status, answer.read().decode(), dict(answer.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


def infer(url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(f"{url}/v2/models/qc/infer", data=INFER_BODY), timeout=10).close()


def test_a_metrics_token_keeps_clients_from_reading_which_version_answered(triton: LocalTriton) -> None:
    settings = gateway_settings(triton.http_url, metrics_token=METRICS_TOKEN, expose_version_headers=False,
                                policies={"qc": {"weights": {"2": 50, "3": 50}}})
    with GatewayThread(settings) as gateway:
        infer(gateway.url)
        for token in (None, "wrong-token", METRICS_TOKEN + "x"):
            status, text, headers = scrape(gateway.url, token)
            assert status == 401 and headers["www-authenticate"] == "Bearer", (status, text)
            assert json.loads(text) == {"error": "/metrics needs 'Authorization: Bearer <metrics_token>'"}
            assert "gateway_requests_total" not in text and triton.http_url.split("//")[1] not in text
        status, text, _ = scrape(gateway.url, METRICS_TOKEN)
        assert status == 200 and 'model="qc"' in text and "gateway_requests_total" in text


def test_metrics_on_a_port_of_their_own(triton: LocalTriton) -> None:
    port = free_port()
    settings = gateway_settings(triton.http_url, metrics_port=port, metrics_token=METRICS_TOKEN,
                                policies={"qc": {"weights": {"2": 100}}})
    with GatewayThread(settings) as gateway:
        infer(gateway.url)
        status, text, _ = scrape(gateway.url, METRICS_TOKEN)
        assert status == 404 and json.loads(text)["error"] == f"/metrics is served on its own port ({port}: " \
                                                             "metrics_port)"
        own = f"http://127.0.0.1:{port}"
        assert scrape(own)[0] == 401
        status, text, _ = scrape(own, METRICS_TOKEN)
        assert status == 200 and 'model="qc"' in text and 'version="2"' in text
    with pytest.raises(OSError):  # stopped with the gateway
        urllib.request.urlopen(f"{own}/metrics", timeout=2)


def test_the_metrics_port_must_be_its_own() -> None:
    with pytest.raises(SettingsError, match="metrics_port 8080 is the HTTP or gRPC port"):
        Settings.load(None, store_url="memory://", metrics_port=8080)
