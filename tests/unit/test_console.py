"""The console's parts that need no browser: sessions, roles, the origin check, the Secure
cookie over TLS, the rollout history it keeps, the one-sentence 'why', and the vendored files."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from gateway.admin.auth import Authenticator, Identity
from gateway.app import Gateway
from gateway.console import vendor
from gateway.console.assets import Assets
from gateway.console.sessions import MAX_SESSIONS, Sessions
from gateway.console.timeline import Timeline
from gateway.console.views import console_actor, split_actor, why
from gateway.errors import Forbidden, Unauthorized
from gateway.settings import Settings
from gateway.store.memory import InMemoryStore
from gateway.telemetry.recorder import Recorder
from gateway.telemetry.sources import RecorderSource

OPERATOR, VIEWER = "operator-token-1", "viewer-token-1"


def test_viewer_tokens_read_and_are_refused_changes() -> None:
    auth = Authenticator({"alice": OPERATOR}, viewers={"vera": VIEWER})
    assert auth.identify(f"Bearer {VIEWER}") == Identity("vera", "viewer")
    assert auth.identify(f"Bearer {OPERATOR}") == Identity("alice", "operator")
    assert auth.actor(f"Bearer {OPERATOR}") == "alice"
    with pytest.raises(Forbidden, match="viewer"):
        auth.actor(f"Bearer {VIEWER}")  # what every change on /admin and every Triton control call asks
    with pytest.raises(Unauthorized):
        auth.token_identity("viewer-token-2")
    assert not Authenticator({}, viewers={"vera": VIEWER}).enabled  # viewers alone do not switch /admin on


def test_settings_refuse_a_viewer_token_equal_to_an_admin_token() -> None:
    with pytest.raises(ValueError, match="same"):
        Settings.load(None, admin_token=OPERATOR, viewer_tokens={"vera": OPERATOR})


def test_a_session_ends_after_its_ttl_and_at_logout_and_the_oldest_goes_first() -> None:
    now = [1000.0]
    sessions = Sessions(60, clock=lambda: now[0])
    session = sessions.open(Identity("alice", "operator"))
    assert sessions.get(session.id) is session and session.csrf_matches(session.csrf)
    assert not session.csrf_matches(None) and not session.csrf_matches("forged")
    now[0] += 59.9
    assert sessions.get(session.id) is session
    now[0] += 0.1
    assert sessions.get(session.id) is None
    other = sessions.open(Identity("alice", "operator"))
    sessions.close(other.id)
    assert sessions.get(other.id) is None
    first = sessions.open(Identity("a", "viewer"))
    for _ in range(MAX_SESSIONS):
        sessions.open(Identity("b", "viewer"))
    assert sessions.get(first.id) is None


def gateway() -> Gateway:
    return Gateway(Settings.load(None, triton_url="http://127.0.0.1:9", store_url="memory://",
                                 admin_tokens={"alice": OPERATOR}, viewer_tokens={"vera": VIEWER},
                                 console_session_ttl_s=600))


def client(scheme: str = "https") -> httpx.AsyncClient:
    """The gateway's ASGI app without its lifespan (a login needs no Triton)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway()), base_url=f"{scheme}://gw.example")


@pytest.mark.parametrize(("scheme", "forwarded", "secure"), [("https", None, True), ("http", None, False),
                                                             ("http", "https", True)])
async def test_the_session_cookie_is_secure_over_tls(scheme: str, forwarded: str | None, secure: bool) -> None:
    """TLS directly, or behind the --workers forwarder that says so in X-Forwarded-Proto."""
    headers = {"Origin": f"{forwarded or scheme}://gw.example"}
    if forwarded:
        headers["X-Forwarded-Proto"] = forwarded
    async with client(scheme) as http:
        answer = await http.post("/console/login", json={"token": OPERATOR}, headers=headers)
    assert answer.status_code == 200, answer.text
    cookie = answer.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Max-Age=600" in cookie
    assert ("Secure" in cookie) is secure
    assert answer.json()["role"] == "operator" and OPERATOR not in answer.text


@pytest.mark.parametrize("headers", [{"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"},
                                     {"Sec-Fetch-Site": "same-site"}, {"Origin": "https://gw.example:8443"},
                                     {"Origin": "null"}])
async def test_a_login_from_elsewhere_is_refused(headers: dict[str, str]) -> None:
    async with client() as http:
        answer = await http.post("/console/login", json={"token": OPERATOR}, headers=headers)
    assert answer.status_code == 403 and "set-cookie" not in answer.headers
    assert answer.headers["content-security-policy"].startswith("default-src 'none'")


def test_the_audit_actor_names_the_console() -> None:
    assert split_actor(console_actor("alice")) == ("alice", "console")
    assert split_actor("alice") == ("alice", "api")


def rollout(at: list[float], client: tuple[int, int, int, int] | None, started_at: float = 1.0,
            state: str = "progressing", weights: dict[str, int] | None = None) -> dict[str, Any]:
    verdicts = [{"at": t, "step": 0, "outcome": "inconclusive", "reason": "r", "canary_client_error_rate": None}
                for t in at]
    evidence = {} if client is None else {"client_errors": dict(zip(
        ("canary_n", "canary_events", "stable_n", "stable_events"), client))}
    return {"model": "qc", "started_at": started_at, "last_transition_at": started_at, "state": state,
            "canary": "3", "stable": "2", "baseline": None, "spec": {"interval_s": 2},
            "weights": weights or {"2": 90, "3": 10}, "verdicts": verdicts, "evidence": evidence}


def test_the_timeline_keeps_every_interval_its_4xx_counts_and_the_weights() -> None:
    recorder = Recorder()
    timeline = Timeline(InMemoryStore(), RecorderSource(recorder))

    async def scenario() -> None:
        await timeline.observe("qc", rollout([10.0], (100, 2, 900, 9)))
        await timeline.observe("qc", rollout([10.0], (100, 2, 900, 9)))  # nothing new: nothing kept twice
        await timeline.observe("qc", rollout([10.0, 12.0], (250, 2, 1800, 27), weights={"2": 50, "3": 50}))

    asyncio.run(scenario())
    history = timeline.history("qc")
    assert history is not None
    assert [i["at"] for i in history["intervals"]] == [10.0, 12.0]
    assert [i["client"] for i in history["intervals"]] == [
        {"canary_n": 100, "canary_4xx": 2, "reference_n": 900, "reference_4xx": 9},
        {"canary_n": 150, "canary_4xx": 0, "reference_n": 900, "reference_4xx": 18}]
    assert [w["weights"] for w in history["weights"]] == [{"2": 90, "3": 10}, {"2": 50, "3": 50}]
    # first seen mid-rollout: the accumulated counts are not one interval's, so none are claimed
    asyncio.run(timeline.observe("qc", rollout([20.0, 22.0], (500, 5, 5000, 5), started_at=19.0)))
    late = timeline.history("qc")
    assert late is not None and late["started_at"] == 19.0 and [i["client"] for i in late["intervals"]] == [None, None]


def test_why_is_answered_in_one_sentence_from_the_verdict() -> None:
    failed = {"outcome": "unhealthy", "metric": "error_rate", "reason": "error rate worse: canary 30% vs 0%"}
    assert why({"state": "rolled_back", "verdicts": [failed], "reason": "rolled back"}) == \
        "Rolled back because error_rate failed: error rate worse: canary 30% vs 0%."
    assert why({"state": "paused", "verdicts": [], "reason": "paused by alice"}) == "Paused: paused by alice."
    held = {"outcome": "inconclusive", "reason": "latency undecided: about 40 more canary requests needed"}
    assert why({"state": "progressing", "step": 1, "verdicts": [held]}) == \
        "Held at step 2: latency undecided: about 40 more canary requests needed."
    assert why({"state": "promoted", "verdicts": []}) is None


def test_the_vendored_files_match_their_manifest_and_the_page_names_only_real_files() -> None:
    assert vendor.check() == 0
    assets = Assets()
    assert "{{" not in assets.page and all(url in assets.page for url in assets.urls.values()
                                            if not url.endswith(".txt"))
