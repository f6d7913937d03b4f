"""Credentials say nothing by their timing or their cookie: tokens are compared as equal-length
digests, and the console's session cookie over TLS is a ``__Host-`` cookie."""

from __future__ import annotations

import hmac
from typing import Any

import httpx
import pytest

from gateway.admin.auth import Authenticator
from gateway.app import Gateway
from gateway.errors import Unauthorized
from gateway.settings import Settings

OPERATOR, VIEWER = "operator-token-1", "a-much-longer-viewer-token-of-48-characters-here"


def test_a_token_is_compared_in_a_time_that_says_nothing_of_its_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hmac.compare_digest`` returns at once for inputs of different lengths: every comparison
    must be of equal-length inputs, whatever the length of the token presented."""
    compared: list[tuple[int, int]] = []
    compare = hmac.compare_digest

    def recording(a: Any, b: Any) -> bool:
        compared.append((len(a), len(b)))
        return compare(a, b)

    monkeypatch.setattr(hmac, "compare_digest", recording)
    authenticator = Authenticator({"alice": OPERATOR}, viewers={"vera": VIEWER})
    for presented in ("x", "operator-token", "operator-token-12", "y" * 4096):
        with pytest.raises(Unauthorized):
            authenticator.token_identity(presented)
    assert authenticator.token_identity(OPERATOR).name == "alice"
    assert authenticator.token_identity(VIEWER).name == "vera"
    assert compared and all(a == b for a, b in compared), compared
    assert len({a for a, _ in compared}) == 1  # one length for every token, presented or held


def gateway() -> Gateway:
    return Gateway(Settings.load(None, triton_url="http://127.0.0.1:9", store_url="memory://",
                                 admin_tokens={"alice": OPERATOR}, console_session_ttl_s=600))


@pytest.mark.parametrize(("scheme", "forwarded"), [("https", None), ("http", "https")])
async def test_over_tls_the_session_cookie_is_a_host_cookie(scheme: str, forwarded: str | None) -> None:
    """``__Host-``: Secure, Path=/, no Domain, so no sibling host or plain-HTTP page can plant or
    replace it; the session it names works, and the unprefixed name is not read over TLS."""
    headers = {"Origin": "https://gw.example"}
    if forwarded:
        headers["X-Forwarded-Proto"] = forwarded
    transport = httpx.ASGITransport(app=gateway())
    async with httpx.AsyncClient(transport=transport, base_url=f"{scheme}://gw.example") as http:
        login = await http.post("/console/login", json={"token": OPERATOR}, headers=headers)
        assert login.status_code == 200, login.text
        cookie = login.headers["set-cookie"]
        name, _, rest = cookie.partition("=")
        attributes = {part.strip().split("=")[0].lower(): part.strip() for part in rest.split(";")[1:]}
        assert name == "__Host-gateway_console"
        assert attributes["path"] == "Path=/" and "secure" in attributes and "domain" not in attributes
        session_id = rest.split(";")[0]
        http.cookies.clear()
        who = await http.get("/console/api/session", headers={**headers, "Cookie": f"{name}={session_id}"})
        assert who.json()["actor"] == "alice"
        planted = await http.get("/console/api/session",
                                 headers={**headers, "Cookie": f"gateway_console={session_id}"})
        assert planted.json()["actor"] is None


async def test_over_plain_http_the_cookie_keeps_its_name_and_console_path() -> None:
    """A browser refuses a Secure cookie from a plain-HTTP page, so no prefix there."""
    transport = httpx.ASGITransport(app=gateway())
    async with httpx.AsyncClient(transport=transport, base_url="http://gw.example") as http:
        login = await http.post("/console/login", json={"token": OPERATOR}, headers={"Origin": "http://gw.example"})
    cookie = login.headers["set-cookie"]
    assert cookie.startswith("gateway_console=") and "Path=/console" in cookie and "Secure" not in cookie
