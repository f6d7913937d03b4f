"""The SRE console (issue 25) in a real headless Chromium against the real gateway and Triton."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from playwright.sync_api import BrowserContext, Page, expect

from gateway.policy import PolicySpec
from gateway.store.base import EventDraft
from tests.conftest import Faults
from tests.console.conftest import OPERATOR_TOKEN, VIEWER_TOKEN, Watched, keep_as_docs, screenshot
from tests.support import BackgroundLoad, GatewayThread, admin_call, wait_for

pytestmark = pytest.mark.triton
MARKUP = '<img src=x onerror="window.__pwned=1">'


def log_in(page: Page, url: str, token: str) -> None:
    """With the keyboard only: the login form is the first thing the page focuses."""
    page.goto(url + "/console")
    expect(page.locator("#token")).to_be_focused()
    page.keyboard.type(token)
    page.keyboard.press("Enter")
    expect(page.locator("#who")).not_to_be_empty()


def model_page(watched: Watched) -> Page:
    """An operator on qc's model page."""
    log_in(watched.page, watched.origin, OPERATOR_TOKEN)
    watched.page.goto(watched.origin + "/console#/model/qc")
    return watched.page


def submit_rollout(page: Page, steps: str, interval_s: str = "30") -> None:
    """The start-a-rollout form, canary version 3, up to its confirmation dialog."""
    form = page.locator("#rollout-form")
    form.get_by_label("Canary version").select_option("3")
    form.get_by_label("Steps (% of traffic, comma separated)").fill(steps)
    form.get_by_label("Interval (s)").fill(interval_s)
    form.locator("button[type=submit]").click()


def act(page: Page, button: str, says: str) -> None:
    """Press an action button and confirm the dialog, which must say exactly what will happen."""
    page.click(button)
    expect(page.locator("#confirm-text")).to_have_text(says)
    page.click("#confirm-ok")


def post(url: str, path: str, body: Any, headers: dict[str, str]) -> tuple[int, Any]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read() or b"null")


def session_of(context: BrowserContext, page: Page) -> tuple[str, str]:
    """The browser's session cookie and the CSRF token its page holds."""
    cookie = next(c for c in context.cookies() if c["name"] == "gateway_console")
    csrf = page.evaluate("fetch('/console/api/session').then(r => r.json()).then(s => s.csrf)")
    return cookie["value"], csrf


def rollout_status(url: str) -> dict[str, Any]:
    status, doc = admin_call(url, "GET", "/admin/models/qc/rollout", token=OPERATOR_TOKEN)
    assert status == 200, doc
    assert isinstance(doc, dict)
    return doc


def qc_revision(url: str) -> int:
    status, doc = admin_call(url, "GET", "/admin/models/qc/policy", token=OPERATOR_TOKEN)
    assert status == 200, doc
    return int(doc["revision"])


def test_a_wrong_token_shows_an_error_and_opens_no_session(watched: Watched, context: BrowserContext) -> None:
    page = watched.page
    page.goto(watched.origin + "/console")
    page.fill("#token", "not-a-token-at-all")
    page.click("#login-form button")
    expect(page.locator("#login-error")).to_contain_text("invalid bearer token")
    expect(page.locator("#login")).to_be_visible()
    assert not [c for c in context.cookies() if c["name"] == "gateway_console"]
    assert page.evaluate("localStorage.length + sessionStorage.length") == 0


def test_login_cookie_headers_caching_and_logout(watched: Watched, context: BrowserContext) -> None:
    page = watched.page
    response = page.goto(watched.origin + "/console")
    assert response is not None
    headers = response.headers
    csp = headers["content-security-policy"]
    assert "script-src 'self'" in csp and "style-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert headers["x-content-type-options"] == "nosniff" and headers["referrer-policy"] == "same-origin"
    scripts = page.eval_on_selector_all("script", "els => els.map(e => [e.src, e.textContent.trim()])")
    assert scripts and all(src and not text for src, text in scripts), "no inline script"
    for src, _ in scripts:
        asset = page.request.get(src)
        assert asset.status == 200 and "immutable" in asset.headers["cache-control"]
        assert "max-age=31536000" in asset.headers["cache-control"]
    log_in(page, watched.origin, OPERATOR_TOKEN)
    cookie = next(c for c in context.cookies() if c["name"] == "gateway_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/console"
    assert 8 * 3600 - 120 < cookie["expires"] - time.time() <= 8 * 3600
    assert not cookie["secure"]  # served over plain HTTP here; Secure over TLS (test_console_security_units)
    assert OPERATOR_TOKEN not in page.url and page.evaluate("localStorage.length + sessionStorage.length") == 0
    old = cookie["value"]
    page.click("#logout")
    expect(page.locator("#login")).to_be_visible()
    status, doc = post(watched.origin, "/console/api/models/qc/rollout/pause", {},
                       {"Cookie": f"gateway_console={old}"})
    assert status == 401, doc  # the session ended on the server, not only in the browser
    request = urllib.request.Request(watched.origin + "/console/api/overview",
                                     headers={"Cookie": f"gateway_console={old}"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    refused.value.close()
    assert refused.value.code == 401


def test_a_viewer_sees_every_page_and_can_change_nothing(watched: Watched, context: BrowserContext,
                                                         console_gateway: GatewayThread) -> None:
    page, url = watched.page, watched.origin
    log_in(page, url, VIEWER_TOKEN)
    expect(page.locator("#who")).to_contain_text("vera (viewer, read-only)")
    expect(page.locator("tr[data-model='qc']")).to_be_visible()
    page.goto(url + "/console#/model/qc")
    expect(page.locator("#policy-weights")).to_have_text("2: 100%")
    controls = page.locator("#actions-slot button, #actions-slot input, #actions-slot select, #actions-slot textarea")
    assert controls.count() >= 8
    enabled = [controls.nth(i).evaluate("e => e.outerHTML") for i in range(controls.count())
               if controls.nth(i).is_enabled()]
    assert not enabled, enabled
    page.goto(url + "/console#/fleets")
    expect(page.locator("main table")).to_contain_text("up")
    page.goto(url + "/console#/audit")
    expect(page.locator("#audit-body table")).to_be_visible()
    # whatever the page shows, the server refuses a viewer's change: a forged POST with a valid CSRF token
    before = qc_revision(url)
    cookie, csrf = session_of(context, page)
    status, doc = post(url, "/console/api/models/qc/weights", {"weights": {"3": 100}},
                       {"Cookie": f"gateway_console={cookie}", "X-CSRF-Token": csrf, "Origin": url})
    assert status == 403 and "viewer" in doc["error"], doc
    # the same from the page's own context (same origin, the browser's cookie)
    answer = page.evaluate("""(csrf) => fetch('/console/api/models/qc/rollout/abort', {method: 'POST',
        headers: {'X-CSRF-Token': csrf, 'Content-Type': 'application/json'}, body: '{}'}).then(r => r.status)""", csrf)
    assert answer == 403
    # viewer tokens read /admin (GET) and change nothing there either
    assert admin_call(url, "GET", "/admin/models/qc/policy", token=VIEWER_TOKEN)[0] == 200
    status, doc = admin_call(url, "PATCH", "/admin/models/qc/policy/weights", {"weights": {"3": 100}},
                             token=VIEWER_TOKEN)
    assert status == 403 and "viewer" in doc["error"], doc
    assert qc_revision(url) == before


def test_a_post_without_csrf_or_from_another_origin_is_refused(watched: Watched, context: BrowserContext) -> None:
    page, url = watched.page, watched.origin
    log_in(page, url, OPERATOR_TOKEN)
    before = qc_revision(url)
    cookie, csrf = session_of(context, page)
    change = {"weights": {"2": 50, "3": 50}}
    jar = {"Cookie": f"gateway_console={cookie}"}
    status, doc = post(url, "/console/api/models/qc/weights", change, {**jar, "Origin": url})
    assert status == 403 and "CSRF" in doc["error"], doc
    status, doc = post(url, "/console/api/models/qc/weights", change, {**jar, "Origin": url, "X-CSRF-Token": "forged"})
    assert status == 403 and "CSRF" in doc["error"], doc
    status, doc = post(url, "/console/api/models/qc/weights", change,
                       {**jar, "X-CSRF-Token": csrf, "Origin": "http://evil.example"})
    assert status == 403 and "cross-origin" in doc["error"], doc
    status, doc = post(url, "/console/api/models/qc/weights", change,
                       {**jar, "X-CSRF-Token": csrf, "Sec-Fetch-Site": "cross-site"})
    assert status == 403 and "cross-site" in doc["error"], doc
    status, doc = post(url, "/console/login", {"token": OPERATOR_TOKEN}, {"Origin": "http://evil.example"})
    assert status == 403, doc
    assert qc_revision(url) == before  # nothing changed
    # and the same request with the token and from the page's own origin goes through
    status, doc = post(url, "/console/api/models/qc/weights", change, {**jar, "X-CSRF-Token": csrf, "Origin": url})
    assert status == 200 and doc["weights"] == {"2": 50, "3": 50}, doc


def test_an_operator_sets_90_10_and_policy_audit_and_overview_show_it(watched: Watched) -> None:
    url = watched.origin
    page = model_page(watched)
    form = page.locator("#weights-form")
    form.get_by_label("version 2 (%)").fill("90")
    form.get_by_label("version 3 (%)").fill("10")
    form.get_by_label("Reason").fill("canary by hand")
    form.locator("button[type=submit]").click()
    expect(page.locator("#confirm-text")).to_have_text("Send 90% of qc to version 2 and 10% of qc to version 3.")
    page.click("#confirm-ok")
    expect(page.locator("#policy-weights")).to_have_text("2: 90%, 3: 10%")
    status, policy = admin_call(url, "GET", "/admin/models/qc/policy", token=OPERATOR_TOKEN)
    assert status == 200 and policy["weights"] == {"2": 90, "3": 10}
    status, events = admin_call(url, "GET", "/admin/events?model=qc&limit=1", token=OPERATOR_TOKEN)
    assert events["events"][0]["actor"] == "alice (via: console)" and events["events"][0]["reason"] == "canary by hand"
    page.goto(url + "/console#/audit?actor=alice&action=set_weights")
    row = page.locator("#audit-body tbody tr").first
    expect(row).to_contain_text("alice")
    expect(row).to_contain_text("via: console")
    expect(row).to_contain_text("canary by hand")
    screenshot(page, "audit")
    page.goto(url + "/console#/overview")
    bar = page.locator("tr[data-model='qc'] .bar")
    expect(bar.locator(".seg[data-version='2']")).to_have_text("2: 90%")
    expect(bar.locator(".seg[data-version='3']")).to_have_text("3: 10%")
    widths = bar.locator(".seg").evaluate_all("segs => segs.map(s => s.getBoundingClientRect().width)")
    assert widths[0] > 8 * widths[1] > 0
    screenshot(page, "overview")


def test_a_failing_canary_is_shown_rolled_back_with_its_reason_and_error_chart(watched: Watched,
                                                                              faults: Faults) -> None:
    url = watched.origin
    faults.set("qc", "3", error_rate=0.3)
    page = model_page(watched)
    with BackgroundLoad(url):
        submit_rollout(page, "10, 50, 100", interval_s="2")
        expect(page.locator("#confirm-text")).to_contain_text("send 10% of qc to version 3 first")
        page.click("#confirm-ok")
        expect(page.locator("#rollout-state")).to_have_text("rolled_back", timeout=40_000)
    why = page.locator("#why")
    expect(why).to_contain_text("error_rate")
    expect(why).to_contain_text("error rate worse")
    assert rollout_status(url)["state"] == "rolled_back"
    chart = page.locator("#chart-error-rate")
    drawn = wait_for(lambda: chart.get_attribute("data-drawn") or None, 10, what="the error-rate chart drawn")
    series = dict(part.rsplit(":", 1) for part in drawn.split(","))
    assert int(series["canary 3"]) >= 1 and int(series["reference 2"]) >= 1, drawn
    assert page.locator("#chart-error-rate canvas").count() == 1
    expect(page.locator("#action-retry")).to_be_enabled()
    page.locator("#why").scroll_into_view_if_needed()
    page.evaluate("window.scrollTo(0, 0)")
    path = screenshot(page, "model")
    keep_as_docs(path)
    page.locator("#charts").scroll_into_view_if_needed()
    screenshot(page, "model-charts")
    faults.clear()
    act(page, "#action-retry", "Start the rollout of version 3 of qc again with the same spec (retry).")
    expect(page.locator("#rollout-state")).to_have_text("progressing")
    assert rollout_status(url)["spec"]["retry"] is True
    act(page, "#action-abort", "Abort the rollout of qc: send 100% of qc to version 2.")
    expect(page.locator("#rollout-state")).to_have_text("aborted")


def test_a_thresholds_rollout_draws_its_default_error_ceiling_on_the_error_chart(watched: Watched) -> None:
    """max_error_rate left null: the chart draws the ceiling the judge applies (0.01), not nothing."""
    url = watched.origin
    with BackgroundLoad(url):
        status, doc = admin_call(url, "POST", "/admin/models/qc/rollout",
                                 {"canary": "3", "judge": "thresholds", "steps": [10], "interval_s": 2,
                                  "min_requests": 5}, token=OPERATOR_TOKEN)
        assert status == 200, doc
        assert doc["spec"]["max_error_rate"] is None
        wait_for(lambda: rollout_status(url)["verdicts"] or None, 30, what="a verdict of the thresholds judge")
    page = model_page(watched)
    chart = page.locator("#chart-error-rate")
    drawn = wait_for(lambda: chart.get_attribute("data-drawn") or None, 10, what="the error-rate chart drawn")
    series = dict(part.rsplit(":", 1) for part in drawn.split(","))
    assert int(series["floor"]) >= 1 and int(series["canary 3"]) >= 1, drawn


def test_an_identical_canary_is_promoted_from_the_promote_button(watched: Watched,
                                                                 console_gateway: GatewayThread) -> None:
    url = watched.origin
    status, doc = admin_call(url, "POST", "/admin/models/qc/rollout", {"canary": "3", "steps": [10], "interval_s": 600},
                             token=OPERATOR_TOKEN)
    assert status == 200, doc
    page = model_page(watched)
    expect(page.locator("#rollout-state")).to_have_text("progressing")
    act(page, "#action-pause", "Pause the rollout of qc at its current weights.")
    expect(page.locator("#rollout-state")).to_have_text("paused")
    expect(page.locator("#why")).to_contain_text("paused by alice (via: console)")
    act(page, "#action-resume",
        "Resume the rollout of qc: its weights (90% to version 2, 10% to version 3) apply again.")
    expect(page.locator("#rollout-state")).to_have_text("progressing")
    page.locator("#action-promote").focus()
    page.keyboard.press("Enter")
    expect(page.locator("#confirm-text")).to_contain_text("send 100% of qc to version 3")
    expect(page.locator("#confirm-cancel")).to_be_focused()  # the safe choice is the default
    page.keyboard.press("Tab")
    expect(page.locator("#confirm-ok")).to_be_focused()
    page.keyboard.press("Enter")
    expect(page.locator("#rollout-state")).to_have_text("promoted")
    doc = rollout_status(url)
    assert doc["state"] == "promoted" and "promoted by alice (via: console)" in doc["reason"]
    def promoted_weights() -> bool:
        weights = admin_call(url, "GET", "/admin/models/qc/policy", token=OPERATOR_TOKEN)[1]["weights"]
        return {v: w for v, w in weights.items() if w} == {"3": 100}

    wait_for(promoted_weights, 10, what="the promoted weights (100% to version 3)")
    status, events = admin_call(url, "GET", "/admin/events?model=qc&limit=20", token=OPERATOR_TOKEN)
    assert any(e["action"] == "rollout_promote" and e["actor"] == "alice (via: console)" for e in events["events"])


def test_markup_in_a_model_name_is_shown_as_text(watched: Watched, console_gateway: GatewayThread) -> None:
    """The name comes in through the store (as from another replica or an older version; the admin
    API itself refuses such a name), and the audit trail."""
    page, url = watched.page, watched.origin
    store = console_gateway.app.store
    console_gateway.call(store.put_policy(MARKUP, PolicySpec.model_validate({"weights": {"1": 100}}), None,
                                          EventDraft(MARKUP, "put_policy", MARKUP)))
    log_in(page, url, OPERATOR_TOKEN)
    link = page.get_by_role("link", name=MARKUP)
    expect(link.first).to_be_visible()
    assert page.locator("main img").count() == 0 and page.evaluate("window.__pwned === undefined")
    link.first.click()
    expect(page.locator("#model-name")).to_have_text(MARKUP)
    page.goto(url + "/console#/audit")
    expect(page.locator("#audit-body tbody tr").first).to_contain_text(MARKUP)
    assert page.locator("main img").count() == 0 and page.evaluate("window.__pwned === undefined")


def test_every_page_reads_at_1280_and_at_phone_width(watched: Watched, console_gateway: GatewayThread) -> None:
    page, url = watched.page, watched.origin
    log_in(page, url, OPERATOR_TOKEN)
    for name, route, ready in (("overview", "#/overview", "tr[data-model='qc']"), ("model-qc", "#/model/qc", "#policy"),
                               ("fleets", "#/fleets", "main table"), ("audit-all", "#/audit", "#audit-body table")):
        page.goto(url + "/console" + route)
        expect(page.locator(ready).first).to_be_visible()
        screenshot(page, name)
    page.set_viewport_size({"width": 390, "height": 844})
    for route, ready in (("#/overview", "tr[data-model='qc']"), ("#/model/qc", "#policy")):
        page.goto(url + "/console" + route)
        expect(page.locator(ready).first).to_be_visible()
        overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
        assert overflow <= 1, f"{route} is {overflow}px wider than a phone's screen"
        screenshot(page, "phone-" + re.sub(r"\W", "", route))


def test_the_watch_catches_inline_script_and_style_refused_by_the_csp(watched: Watched) -> None:
    """The check every test ends with can fail: markup slipped into the page is refused and reported."""
    page = watched.page
    log_in(page, watched.origin, OPERATOR_TOKEN)
    page.evaluate("""() => { const s = document.createElement('script'); s.textContent = 'window.__inline = 1';
        document.body.append(s); document.body.setAttribute('style', 'color: red'); }""")
    wait_for(lambda: len(watched.problems()) >= 2, 5, what="both violations reported")
    problems = watched.problems()
    assert any("script-src" in p for p in problems) and any("style-src" in p for p in problems), problems
    assert page.evaluate("window.__inline === undefined")
    page.evaluate("window.__csp.length = 0")  # seen: the fixture's own check must not fail on them
    watched.errors.clear()


def test_a_refused_rollout_shows_the_apis_422_next_to_the_field(watched: Watched) -> None:
    url = watched.origin
    page = model_page(watched)
    submit_rollout(page, "50, 20")
    page.click("#confirm-ok")
    expect(page.locator("#ro-steps-error")).to_contain_text("steps must be strictly ascending")
    expect(page.locator("#ro-steps")).to_have_attribute("aria-describedby", "ro-steps-error")
    page.locator("#ro-json").fill('{"bogus": 1}')
    submit_rollout(page, "10, 100")
    page.click("#confirm-ok")
    expect(page.locator("#ro-json-error")).to_contain_text("bogus")
    expect(page.locator("#ro-steps-error")).to_have_count(0)
    status, doc = admin_call(url, "GET", "/admin/models/qc/rollout", token=OPERATOR_TOKEN)
    assert status == 404, doc  # nothing started


def test_an_operator_unloads_and_loads_a_version(watched: Watched) -> None:
    url = watched.origin
    page = model_page(watched)
    page.locator("[data-unload='1']").click()
    expect(page.locator("#confirm-text")).to_have_text("Drain and unload version 1 of qc.")
    page.click("#confirm-ok")
    expect(page.locator("[data-unload='1']")).to_have_count(0, timeout=60_000)
    page.get_by_label("Load version").fill("1")
    page.locator("#action-load").click()
    expect(page.locator("#confirm-text")).to_have_text("Load version 1 of qc beside the serving versions.")
    page.click("#confirm-ok")
    expect(page.locator("[data-unload='1']")).to_have_count(1, timeout=60_000)
    status, events = admin_call(url, "GET", "/admin/events?model=qc&limit=10", token=OPERATOR_TOKEN)
    mine = [(e["action"], e["actor"]) for e in events["events"] if e["actor"] == "alice (via: console)"]
    assert ("version_unloaded", "alice (via: console)") in mine and ("version_loaded", "alice (via: console)") in mine


def test_the_page_polls_every_2_s_pauses_while_hidden_and_says_when_data_is_stale(watched: Watched) -> None:
    page, url = watched.page, watched.origin
    log_in(page, url, OPERATOR_TOKEN)
    polls: list[float] = []
    page.on("request", lambda request: polls.append(time.monotonic()) if "/console/api/overview" in request.url
            else None)
    deadline = time.monotonic() + 15
    while len(polls) < 3 and time.monotonic() < deadline:
        page.wait_for_timeout(200)  # Playwright delivers the page's events while it waits
    gaps = [b - a for a, b in zip(polls, polls[1:])]
    assert all(gap >= 1.9 for gap in gaps), gaps  # 2 s after the previous answer, never faster
    expect(page.locator("#stale")).to_be_hidden()
    page.evaluate("""() => { Object.defineProperty(document, 'hidden', {value: true, configurable: true});
        document.dispatchEvent(new Event('visibilitychange')); }""")
    expect(page.locator("#live")).to_have_text("paused (tab hidden)")
    seen = len(polls)
    page.wait_for_timeout(4500)
    assert len(polls) == seen  # nothing asked while hidden
    page.route("**/console/api/overview", lambda route: route.abort())  # the gateway stops answering
    page.evaluate("""() => { Object.defineProperty(document, 'hidden', {value: false, configurable: true});
        document.dispatchEvent(new Event('visibilitychange')); }""")
    expect(page.locator("#stale")).to_contain_text("Stale data")
    expect(page.locator("#stale")).to_contain_text("last update")
    page.unroute("**/console/api/overview")
    expect(page.locator("#stale")).to_be_hidden(timeout=6000)
    watched.errors[:] = [e for e in watched.errors if "ERR_FAILED" not in e]  # the aborted requests, on purpose
