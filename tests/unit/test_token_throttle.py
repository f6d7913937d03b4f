"""One failure counter for every place a token is tried, per client (issue 32): the console's
login, ``/admin``'s bearer token, the data ports' control token and ``/metrics``' token share it;
a client is its IPv6 /64 and, behind a trusted proxy, whom the proxy forwarded; a right token,
another identity's above all, clears nothing; each lockout is one log line."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from gateway.admin.throttle import FREE_FAILURES
from gateway.app import Gateway
from gateway.settings import Settings

OPERATOR, VIEWER, METRICS = "operator-token-1", "viewer-token-1", "metrics-token-1"
ORIGIN = {"Origin": "https://gw.example"}


def gateway(**settings: Any) -> Gateway:
    return Gateway(Settings.load(None, triton_url="http://127.0.0.1:9", store_url="memory://",
                                 admin_tokens={"alice": OPERATOR}, viewer_tokens={"vera": VIEWER},
                                 metrics_token=METRICS, **settings))


def client(app: Gateway, address: str = "192.0.2.10") -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(address, 40000))
    return httpx.AsyncClient(transport=transport, base_url="https://gw.example")


def bearer(token: str, **more: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", **more}


async def test_the_admin_api_takes_a_few_wrong_tokens_then_makes_the_client_wait(
        caplog: pytest.LogCaptureFixture) -> None:
    """300 wrong tokens took 0.1 s there, none logged."""
    caplog.set_level(logging.DEBUG, logger="gateway.auth")
    async with client(gateway()) as http:
        codes = [(await http.get("/admin/models", headers=bearer(f"guess-{n}-xxxx"))).status_code
                 for n in range(FREE_FAILURES + 3)]
        locked = await http.get("/admin/models", headers=bearer(OPERATOR))
    assert codes == [401] * (FREE_FAILURES + 1) + [429] * 2
    assert locked.status_code == 429 and int(locked.headers["retry-after"]) >= 1
    assert "too many wrong tokens" in locked.json()["error"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and "the admin API" in warnings[1], warnings  # the first, and the lockout
    assert not any("guess" in r.getMessage() for r in caplog.records)


async def test_one_count_for_the_console_the_admin_api_and_metrics() -> None:
    app = gateway()
    async with client(app) as http:
        for _ in range(2):
            assert (await http.post("/console/login", json={"token": "guess-console"}, headers=ORIGIN)
                    ).status_code == 401
            assert (await http.get("/admin/models", headers=bearer("guess-admin-x"))).status_code == 401
        assert (await http.get("/metrics", headers=bearer("guess-metrics"))).status_code == 401
        assert (await http.get("/metrics", headers=bearer(METRICS))).status_code == 200  # 5 wrong: the free ones
        assert (await http.get("/admin/models", headers=bearer("guess-admin-y"))).status_code == 401  # the 6th
        assert (await http.post("/console/login", json={"token": OPERATOR}, headers=ORIGIN)).status_code == 429
        assert (await http.get("/metrics", headers=bearer(METRICS))).status_code == 429
        assert (await http.get("/admin/models", headers=bearer(OPERATOR))).status_code == 429


async def test_another_identitys_success_clears_nothing() -> None:
    """A viewer guessing the operator's token logged in as itself between guesses: never locked out."""
    async with client(gateway()) as http:
        statuses = []
        for n in range(FREE_FAILURES + 2):
            statuses.append((await http.get("/admin/models", headers=bearer(f"operator-guess-{n}"))).status_code)
            statuses.append((await http.post("/console/login", json={"token": VIEWER}, headers=ORIGIN)).status_code)
    assert statuses[:2 * FREE_FAILURES] == [401, 200] * FREE_FAILURES
    assert statuses[-2:] == [429, 429], statuses


async def test_an_ipv6_client_is_its_64() -> None:
    app = gateway()
    for n in range(FREE_FAILURES + 1):
        async with client(app, f"2001:db8:7:7::{n + 1:x}") as http:
            assert (await http.get("/admin/models", headers=bearer("guess-v6-xx"))).status_code == 401
    async with client(app, "2001:db8:7:7:ffff::1") as http:
        assert (await http.get("/admin/models", headers=bearer(OPERATOR))).status_code == 429
    async with client(app, "2001:db8:7:8::1") as http:  # another /64
        assert (await http.get("/admin/models", headers=bearer(OPERATOR))).status_code == 200


async def test_behind_a_trusted_proxy_each_forwarded_client_has_its_own_count() -> None:
    """Every user shared the proxy's count: six wrong tries locked a colleague's right token out."""
    app = gateway(trusted_proxies=["10.0.0.0/8"])
    async with client(app, "10.0.0.2") as http:
        for _ in range(FREE_FAILURES + 1):
            answer = await http.post("/console/login", json={"token": "guess-proxy"},
                                     headers={**ORIGIN, "X-Forwarded-For": "203.0.113.5"})
            assert answer.status_code == 401
        colleague = await http.post("/console/login", json={"token": OPERATOR},
                                    headers={**ORIGIN, "X-Forwarded-For": "203.0.113.6"})
        guesser = await http.post("/console/login", json={"token": OPERATOR},
                                  headers={**ORIGIN, "X-Forwarded-For": "203.0.113.5"})
    assert (colleague.status_code, guesser.status_code) == (200, 429)
    async with client(app, "192.0.2.77") as http:  # an untrusted peer's header is never believed
        for n in range(FREE_FAILURES + 1):
            await http.get("/admin/models", headers=bearer("guess-spoof", **{"X-Forwarded-For": f"198.51.100.{n}"}))
        assert (await http.get("/admin/models", headers=bearer(OPERATOR))).status_code == 429
