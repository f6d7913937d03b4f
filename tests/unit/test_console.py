"""The console's parts that need no browser: sessions, roles, the origin check, the Secure
cookie over TLS, the rollout history it keeps, the one-sentence 'why', and the vendored files."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest

from gateway.admin.auth import Authenticator, Identity
from gateway.admin.throttle import FORGET_AFTER_S, FREE_FAILURES, MAX_LOCKOUT_S, TokenThrottle
from gateway.app import Gateway
from gateway.console import vendor
from gateway.console.assets import Assets
from gateway.console.sessions import MAX_SESSIONS, MAX_SESSIONS_PER_LOGIN, Sessions
from gateway.console.timeline import Timeline
from gateway.console.views import console_actor, split_actor, why
from gateway.errors import Forbidden, TooManyAttempts, Unauthorized
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
    for n in range(MAX_SESSIONS):  # as many logins as the table holds: the oldest session ends
        sessions.open(Identity(f"b{n}", "viewer"))
    assert sessions.get(first.id) is None


def test_one_login_logging_in_again_and_again_ends_only_its_own_oldest_sessions() -> None:
    """A viewer logging in 10,050 times once ended every operator's session (one shared table)."""
    now = [1000.0]
    sessions = Sessions(60, clock=lambda: now[0])
    operator = sessions.open(Identity("alice", "operator"))
    viewer = [sessions.open(Identity("vera", "viewer")) for _ in range(MAX_SESSIONS + 50)]
    assert sessions.get(operator.id) is operator
    alive = [session for session in viewer if sessions.get(session.id) is not None]
    assert alive == viewer[-MAX_SESSIONS_PER_LOGIN:], "the viewer keeps only its newest sessions"


def test_expired_sessions_go_before_anyone_live_is_dropped() -> None:
    now = [1000.0]
    sessions = Sessions(60, clock=lambda: now[0])
    stale = [sessions.open(Identity(f"old{n}", "viewer")) for n in range(MAX_SESSIONS - 1)]
    now[0] += 61  # all of them expired, none read since
    live = sessions.open(Identity("alice", "operator"))
    newcomers = [sessions.open(Identity(f"new{n}", "viewer")) for n in range(5)]
    assert len(sessions) == 6, "the expired ones were purged, not kept until the table overflowed"
    assert sessions.get(live.id) is live and all(sessions.get(s.id) is s for s in newcomers)
    assert all(sessions.get(s.id) is None for s in stale)


def test_failed_logins_from_one_address_back_off_and_are_forgotten() -> None:
    now = [1000.0]
    throttle = TokenThrottle(clock=lambda: now[0])
    for _ in range(FREE_FAILURES):
        throttle.check("10.0.0.7")
        throttle.failed("10.0.0.7", "the console")
    throttle.check("10.0.0.7")  # the free ones cost nothing
    waits = []
    for _ in range(12):
        throttle.failed("10.0.0.7", "the console")
        with pytest.raises(TooManyAttempts) as refused:
            throttle.check("10.0.0.7")
        waits.append(refused.value.retry_after_s)
        assert refused.value.headers == ((b"retry-after", str(refused.value.retry_after_s).encode()),)
        throttle.check("10.0.0.8")  # another address is not held back
        now[0] += refused.value.retry_after_s
        throttle.check("10.0.0.7")  # the wait is over
    assert waits[:4] == [1, 2, 4, 8] and max(waits) == MAX_LOCKOUT_S == waits[-1]
    throttle.failed("10.0.0.7", "the console")
    now[0] += FORGET_AFTER_S
    throttle.check("10.0.0.7")
    throttle.failed("10.0.0.7", "the console")  # forgotten: a first failure again, no wait
    throttle.check("10.0.0.7")


async def test_a_login_flood_gets_429_with_retry_after_and_a_few_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    headers = {"Origin": "https://gw.example"}
    caplog.set_level(logging.DEBUG, logger="gateway.auth")
    async with client() as http:
        codes = [(await http.post("/console/login", json={"token": f"guess-{n}"}, headers=headers)).status_code
                 for n in range(FREE_FAILURES + 1)]
        assert codes == [401] * (FREE_FAILURES + 1)
        for token in ("guess-x", OPERATOR):  # while locked out, even the right token waits
            answer = await http.post("/console/login", json={"token": token}, headers=headers)
            assert answer.status_code == 429 and int(answer.headers["retry-after"]) >= 1
            assert "too many wrong tokens" in answer.json()["error"] and "set-cookie" not in answer.headers
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "wrong token" in r.getMessage()]
    assert len(warnings) == 2, [r.getMessage() for r in warnings]  # the first failure, and the lockout
    assert all("guess" not in r.getMessage() for r in caplog.records)  # never the token


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
    # a rollback's sentence goes on in the words of the metric it names (another one failed too)
    worse = "Error rate is worse: the canary's rate is +30.00 points against the stable's."
    metrics = [{"name": "latency", "verdict": "pass", "words": "Latency is fine."},
               {"name": "error_ceiling", "verdict": "fail", "words": "Past the ceiling too."},
               {"name": "error_rate", "verdict": "fail", "words": worse}]
    assert why({"state": "rolled_back", "verdicts": [{**failed, "metrics": metrics}], "reason": "rolled back"}) == \
        f"Rolled back because error_rate failed: error rate worse: canary 30% vs 0%. In words: {worse}"


def test_the_vendored_files_match_their_manifest_and_the_page_names_only_real_files() -> None:
    assert vendor.check() == 0
    assets = Assets()
    assert "{{" not in assets.page and all(url in assets.page for url in assets.urls.values()
                                            if not url.endswith(".txt"))


async def test_the_login_limit_is_per_client_behind_the_workers_forwarder_and_not_forgeable() -> None:
    """Over the control plane's Unix socket (no peer address) each client is the address the
    worker's forwarder appended; a TCP client's own X-Forwarded-For changes nothing."""
    origin = {"Origin": "https://gw.example"}
    unix = httpx.ASGITransport(app=gateway(), client=None)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=unix, base_url="https://gw.example") as http:
        for _ in range(FREE_FAILURES + 1):
            await http.post("/console/login", json={"token": "guess"},
                            headers={**origin, "X-Forwarded-For": "203.0.113.9, 10.0.0.1"})
        locked = await http.post("/console/login", json={"token": OPERATOR},
                                 headers={**origin, "X-Forwarded-For": "10.0.0.1"})
        other = await http.post("/console/login", json={"token": OPERATOR},
                                headers={**origin, "X-Forwarded-For": "10.0.0.2"})
    assert (locked.status_code, other.status_code) == (429, 200)
    async with client() as http:  # a TCP peer: one address whatever header it writes
        for n in range(FREE_FAILURES + 1):
            await http.post("/console/login", json={"token": "guess"},
                            headers={**origin, "X-Forwarded-For": f"10.1.0.{n}"})
        answer = await http.post("/console/login", json={"token": OPERATOR},
                                 headers={**origin, "X-Forwarded-For": "10.1.0.99"})
    assert answer.status_code == 429



def test_live_figures_cover_the_current_interval_never_before_the_weights_changed() -> None:
    """Issue 33 (friction 2): the overview's live figures were a 5-minute average."""
    from gateway.console.views import live_window

    now = 10_000.0
    assert live_window({"updated_at": now - 3600}, None, now) == {"seconds": 30.0, "label": "the last 30 s"}
    changed = live_window({"updated_at": now - 12.5}, None, now)
    assert changed == {"seconds": 12.5, "label": "the last 12 s (since the weights changed)"}
    rollout = {"state": "progressing", "spec": {"interval_s": 60}, "step_started_at": now - 20,
               "last_transition_at": now - 20}
    assert live_window({"updated_at": now - 3600}, rollout, now) == {
        "seconds": 20.0, "label": "this interval: the last 20 s of the rollout's 60 s (since the weights changed)"}
    paused = {**rollout, "state": "paused", "step_started_at": now - 500, "last_transition_at": now - 400}
    assert live_window({"updated_at": now - 3600}, paused, now)["seconds"] == 60.0
    assert live_window({"updated_at": now - 0.2}, paused, now)["seconds"] == 1.0  # at least the current second
    assert live_window(None, {**rollout, "state": "promoted"}, now)["seconds"] == 30.0
