"""Issue 33: a console an on-call SRE can trust at a glance, in a real headless Chromium (Debian's).

One gateway and one browser for the module; the tests run in order on its state (the live
figures, a rolled-back canary, a canary promoted by hand, missing models and versions, an
expired session) and the last one reads every page at 1440x900 and at 390x844: no word broken
across lines (no text node narrower than its longest word) and no page scrolling sideways
outside a table. It also takes the screenshots of docs/console.md (``make screenshots`` keeps
them: CONSOLE_SCREENSHOTS=docs/screenshots).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, BrowserContext, Page, ViewportSize, expect

from gateway.devtools.local_triton import LocalTriton
from tests.conftest import Faults
from tests.console.conftest import OPERATOR_TOKEN, VIEWER_TOKEN, WATCH, Watched, screenshot
from tests.support import BackgroundLoad, GatewayThread, admin_call, gateway_settings, wait_for

pytestmark = pytest.mark.triton
WIDE, PHONE = ViewportSize(width=1440, height=900), ViewportSize(width=390, height=844)
ROOT = Path(__file__).resolve().parents[2]
# A word: what a line may not break inside (a line may break after a hyphen or a dash).
LAYOUT = r"""
() => {
  const problems = [];
  const doc = document.documentElement;
  if (doc.scrollWidth > doc.clientWidth + 1) {
    problems.push(`the page scrolls sideways: ${doc.scrollWidth}px wide in ${doc.clientWidth}px`);
  }
  const range = document.createRange();
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const where = node.parentElement;
    if (!where || !where.getClientRects().length) continue;  // not rendered
    const words = /[^\s\-–—]{2,}/g;
    for (let m = words.exec(node.textContent); m; m = words.exec(node.textContent)) {
      range.setStart(node, m.index);
      range.setEnd(node, m.index + m[0].length);
      const lines = [...range.getClientRects()].filter((r) => r.width > 0).length;
      if (lines > 1) {
        problems.push(`"${m[0].slice(0, 40)}" broken over ${lines} lines in <${where.tagName.toLowerCase()}` +
          `${where.id ? "#" + where.id : ""}${where.className ? "." + String(where.className).split(" ")[0] : ""}>`);
        break;
      }
    }
  }
  return problems;
}
"""


@pytest.fixture(scope="module")
def gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    """qc all on version 2, the model repository readable (the version pages compare files)."""
    settings = gateway_settings(triton.http_url, admin_tokens={"alice": OPERATOR_TOKEN},
                                viewer_tokens={"vera": VIEWER_TOKEN}, controller_tick_s=0.2,
                                policies={"qc": {"weights": {"2": 100}}}, model_repository=str(triton.repository))
    with GatewayThread(settings) as running:
        yield running


@pytest.fixture
def page(browser: Browser, gateway: GatewayThread) -> Iterator[Page]:
    """A logged-in operator at 1440x900; any JavaScript error, CSP violation or request outside
    the gateway fails the test."""
    context: BrowserContext = browser.new_context(viewport=WIDE)
    context.add_init_script(WATCH)
    opened = context.new_page()
    watched = Watched(opened, gateway.url)
    opened.on("pageerror", lambda exc: watched.errors.append(f"JavaScript error: {exc}"))
    opened.on("console", lambda m: watched.errors.append(f"console error: {m.text}")
              if m.type == "error" and not m.text.startswith("Failed to load resource") else None)
    opened.on("request", lambda r: None if r.url.startswith((gateway.url, "data:", "blob:", "about:"))
              else watched.errors.append(f"request outside the gateway: {r.url}"))
    log_in(opened, gateway.url)
    yield opened
    problems = watched.problems()
    context.close()
    assert not problems, problems


def log_in(page: Page, url: str, token: str = OPERATOR_TOKEN) -> None:
    page.goto(url + "/console")
    page.fill("#token", token)
    page.press("#token", "Enter")
    expect(page.locator("#who")).not_to_be_empty()


@pytest.fixture(autouse=True)
def no_rollout_running(gateway: GatewayThread) -> Iterator[None]:
    """Each test starts with no active rollout of qc, whatever the one before left."""
    status, doc = admin_call(gateway.url, "GET", "/admin/models/qc/rollout", token=OPERATOR_TOKEN)
    if status == 200 and doc["state"] in ("progressing", "paused", "rolling_back"):
        call(gateway, "POST", "/admin/models/qc/rollout/abort")
    yield


def call(gateway: GatewayThread, method: str, path: str, body: Any = None) -> Any:
    status, doc = admin_call(gateway.url, method, path, body, token=OPERATOR_TOKEN)
    assert status == 200, doc
    return doc


def state_of(gateway: GatewayThread) -> str:
    return str(call(gateway, "GET", "/admin/models/qc/rollout")["state"])


def judged_rollout(gateway: GatewayThread) -> None:
    """A rollout of qc with a verdict or more (the charts' data), made here if none has one yet:
    each test stands on its own, whatever ran before it."""
    status, doc = admin_call(gateway.url, "GET", "/admin/models/qc/rollout", token=OPERATOR_TOKEN)
    if status == 200 and doc["verdicts"]:
        return
    call(gateway, "PATCH", "/admin/models/qc/policy/weights", {"weights": {"2": 100}})
    with BackgroundLoad(gateway.url):
        wait_for(lambda: gateway.app.recorder.window("qc", "2", 1).requests >= 10, 20, what="traffic")
        call(gateway, "POST", "/admin/models/qc/rollout", {"canary": "3", "steps": [10], "interval_s": 1,
                                                           "judge": "thresholds", "min_requests": 1, "retry": True})
        wait_for(lambda: state_of(gateway) == "promoted", 30, what="a promotion")


def confirm(page: Page, button: str) -> str:
    """Press an action button; the dialog's sentence and what else it says; confirm."""
    page.click(button)
    expect(page.locator("#confirm")).to_be_visible()
    said = page.locator("#confirm-text").inner_text() + " | " + page.locator("#confirm-effects").inner_text()
    page.click("#confirm-ok")
    return said


def test_live_figures_are_the_rollouts_interval_labelled_with_their_window(page: Page, gateway: GatewayThread,
                                                                           faults: Faults) -> None:
    """Friction 2: a canary's errors from before its rollout no longer show as live (a 5-minute
    average showed a bad canary's 2.47% during the next, healthy rollout)."""
    call(gateway, "PATCH", "/admin/models/qc/policy/weights", {"weights": {"2": 60, "3": 40}})
    faults.set("qc", "3", error_rate=0.5)
    with BackgroundLoad(gateway.url):
        wait_for(lambda: gateway.app.recorder.window("qc", "3", 30).errors >= 20, 20, what="errors of version 3")
    faults.clear()
    time.sleep(1.1)  # the recorder counts whole seconds: the errors' last second ends before the start
    call(gateway, "POST", "/admin/models/qc/rollout", {"canary": "3", "steps": [5, 100], "interval_s": 600})
    with BackgroundLoad(gateway.url):
        wait_for(lambda: gateway.app.recorder.window("qc", "2", 2).requests >= 20, 20, what="traffic in the rollout")
        page.goto(gateway.url + "/console#/overview")
        expect(page.locator("tr[data-model='qc']")).to_contain_text("v2:")
        assert gateway.app.recorder.window("qc", "3", 60).errors >= 20  # the errors are in the last minute...
        overview = page.evaluate("fetch('/console/api/overview').then((r) => r.json())")
        qc = next(m for m in overview["models"] if m["name"] == "qc")
        assert qc["live"]["3"]["errors"] == 0, qc["live"]  # ...and not in the figures that say "live"
        assert qc["live_window"]["seconds"] < 60, qc["live_window"]
        cell = page.locator("tr[data-model='qc'] .live-cell")
        expect(cell).to_contain_text("this interval: the last")
        expect(cell).to_contain_text("of the rollout's 600 s")
    call(gateway, "POST", "/admin/models/qc/rollout/abort")


def test_a_rolled_back_canary_in_words_needs_attention_until_acknowledged_and_stays_in_the_history(
        page: Page, gateway: GatewayThread, faults: Faults) -> None:
    """Frictions 6 and 8, and the verdicts' words: evidence said in words beside the numbers; the
    rollback waits in Needs attention for an acknowledgement; the next rollout keeps it listed."""
    call(gateway, "PATCH", "/admin/models/qc/policy/weights", {"weights": {"2": 100}})
    faults.set("qc", "3", error_rate=0.3)
    with BackgroundLoad(gateway.url):
        call(gateway, "POST", "/admin/models/qc/rollout", {"canary": "3", "steps": [10, 50, 100], "interval_s": 2,
                                                           "retry": True})
        wait_for(lambda: state_of(gateway) == "rolled_back", 40, what="the rollback")
    faults.clear()
    page.goto(gateway.url + "/console#/model/qc")
    expect(page.locator("#why")).to_contain_text("In words: Error rate")  # on top, the first thing read
    expect(page.locator("#why")).to_contain_text("likelier if the canary is worse than if it is as good")
    words = page.locator("#rollout .evidence .words").first
    expect(words).to_contain_text("likelier if the canary is worse than if it is as good as the stable")
    expect(page.locator("#rollout .evidence .numbers").first).to_contain_text("e-value")
    page.goto(gateway.url + "/console#/overview")
    flagged = page.locator(".attention li", has_text="rollout of qc was rolled back")
    expect(flagged).to_be_visible()
    said = confirm(page, "[data-acknowledge='qc']")
    assert said.startswith("Acknowledge the rollback of qc: it leaves Needs attention"), said
    expect(flagged).to_have_count(0)
    events = call(gateway, "GET", "/admin/events?model=qc&limit=3")["events"]
    assert events[0]["action"] == "rollout_acknowledged" and events[0]["actor"] == "alice (via: console)"
    # a new rollout of the same canary: the rolled-back one stays listed with its verdicts
    page.goto(gateway.url + "/console#/model/qc")
    expect(page.locator("#action-retry")).to_be_enabled()
    said = confirm(page, "#action-retry")
    assert "again with the same spec" in said
    expect(page.locator("#rollout-state")).to_have_text("progressing")
    past = page.locator("#past-rollouts tbody tr").first
    expect(past).to_contain_text("rolled_back")
    expect(past).to_contain_text("acknowledged by alice (via: console)")
    # weights set by hand during it: the confirmation says the rollout pauses
    form = page.locator("#weights-form")
    form.get_by_label("version 2 (%)").fill("80")
    form.get_by_label("version 3 (%)").fill("20")
    said = confirm(page, "#weights-form button[type=submit]")
    assert "the rollout of qc (progressing, step 1 of 3) pauses" in said, said
    expect(page.locator("#rollout-state")).to_have_text("paused")
    said = confirm(page, "#action-abort")
    expect(page.locator("#rollout-state")).to_have_text("aborted")


def test_charts_mark_weight_changes_give_p99_its_own_panel_and_draw_one_point_sanely(
        page: Page, gateway: GatewayThread) -> None:
    """Friction 4: one verdict drew a two-year time axis; p99 spikes set the latency axis so the
    median lay flat; nothing marked where the weights changed."""
    call(gateway, "PATCH", "/admin/models/qc/policy/weights", {"weights": {"2": 100}})
    with BackgroundLoad(gateway.url):
        # traffic first, and one canary request is enough: the first interval is judged healthy (one point)
        wait_for(lambda: gateway.app.recorder.window("qc", "2", 1).requests >= 10, 20, what="traffic")
        call(gateway, "POST", "/admin/models/qc/rollout", {
            "canary": "3", "steps": [10], "interval_s": 3, "judge": "thresholds", "min_requests": 1,
            "max_p99_ratio": 1000, "max_error_rate": 1, "manual_gates": True, "retry": True})
        # one verdict, healthy, then a wait for a promote: 3 s hold canary requests whatever the load,
        # and no limit a loaded machine could cross (a p99 of version 3 warming up) makes it two
        wait_for(lambda: call(gateway, "GET", "/admin/models/qc/rollout")["awaiting_promote"], 30,
                 what="one healthy verdict, then a wait for a promote")
        page.goto(gateway.url + "/console#/model/qc")
        chart = page.locator("#chart-error-rate")
        expect(chart).to_have_attribute("data-drawn", "canary 3:1,canary 3 low:1,canary 3 high:1,reference 2:1,"
                                        "reference 2 low:1,reference 2 high:1,floor:1")
        span = chart.evaluate("() => { const u = state.charts.get('chart-error-rate').plot; "
                              "return u.scales.x.max - u.scales.x.min; }")
        assert span <= 60, f"one point drawn over {span / 86400:.0f} days, not a few intervals of 3 s"
        latency = page.locator("#chart-latency")
        expect(latency).to_have_attribute("data-drawn", "canary 3 p50:1,canary 3 p90:1,reference 2 p50:1,"
                                          "reference 2 p90:1")
        expect(page.locator("#chart-latency-p99")).to_have_attribute("data-drawn", "canary 3 p99:1,reference 2 p99:1")
        said = confirm(page, "#action-promote")
        assert "send 100% of qc to version 3 now" in said
        expect(page.locator("#rollout-state")).to_have_text("promoted")
        wait_for(lambda: call(gateway, "GET", "/admin/models/qc/policy")["weights"].get("3") == 100, 10,
                 what="the promoted weights")
    expect(chart).to_have_attribute("data-marks", "1")  # the promotion's weights, on every chart
    expect(latency).to_have_attribute("data-marks", "1")
    shown = [float(v) for v in latency.evaluate("""() => { const u = state.charts.get('chart-latency').plot;
        return u.data.slice(1).flat().filter((v) => v !== null); }""")]
    assert float(latency.get_attribute("data-ymax") or 0) <= max(shown) * 1.2, "the p50/p90 axis fits p50/p90"


def test_a_missing_model_or_version_is_not_found_and_an_unloaded_version_points_to_loading_it(
        page: Page, gateway: GatewayThread) -> None:
    """Friction 7: '#/model/qcc' drew a whole page with every action on it."""
    call(gateway, "PATCH", "/admin/models/qc/policy/weights", {"weights": {"3": 100}})  # the stable: 3
    page.goto(gateway.url + "/console#/model/qcc")
    expect(page.locator("#not-found")).to_contain_text("model 'qcc' not found")
    expect(page.locator("#not-found")).to_contain_text("qc")  # the models that exist, as links
    enabled = page.locator("#page button:enabled, #page input:enabled, #page select:enabled, #page textarea:enabled")
    expect(enabled).to_have_count(0)
    page.goto(gateway.url + "/console#/model/qc/version/9")
    expect(page.locator("#not-found")).to_contain_text("version 9 of model 'qc' not found")
    expect(enabled).to_have_count(0)
    # version 4 is in the repository, not loaded (config.pbtxt serves 1-3): the page says how to load it
    page.goto(gateway.url + "/console#/model/qc/version/4")
    expect(page.locator("#load-hint")).to_contain_text("Load it to serve it or roll it out")
    expect(page.locator("#load-hint")).to_contain_text("gateway ctl versions load qc 4")
    expect(page.locator("#action-load-version")).to_be_enabled()
    expect(page.locator("#files-summary")).to_contain_text("differ from version 3 of qc")  # the promoted stable
    expect(page.locator("#differences tr[data-file='model.py']")).to_contain_text("changed")
    page.goto(gateway.url + "/console#/model/qc/version/2")
    expect(page.locator("#config-note")).to_contain_text("Triton keeps one per model")
    expect(page.locator("#files-summary")).to_contain_text("every file is the same as in version 3 of qc")
    expect(page.locator("#load-hint")).to_have_count(0)


def test_an_expired_session_keeps_what_was_typed(page: Page, gateway: GatewayThread) -> None:
    page.goto(gateway.url + "/console#/model/qc")
    form = page.locator("#weights-form")
    form.get_by_label("version 2 (%)").fill("95")
    form.get_by_label("version 3 (%)").fill("5")
    form.get_by_label("Reason").fill("typed before the session ended")
    page.evaluate("stopPolling()")  # no poll meets the ended session first: the submit does
    page.context.clear_cookies()  # the session is gone, as after its ttl or a restart
    form.locator("button[type=submit]").click()
    page.click("#confirm-ok")
    expect(page.locator("#login")).to_be_visible()
    expect(page.locator("#login-error")).to_contain_text("what you typed is kept")
    page.fill("#token", OPERATOR_TOKEN)
    page.press("#token", "Enter")
    expect(page.locator("#weights-reason")).to_have_value("typed before the session ended")
    expect(form.get_by_label("version 3 (%)")).to_have_value("5")
    said = confirm(page, "#weights-form button[type=submit]")
    assert said.startswith("Send 95% of qc to version 2 and 5% of qc to version 3.")
    expect(page.locator("#policy-weights")).to_have_text("2: 95%, 3: 5%")


PAGES = (("login", None, "#login"), ("overview", "#/overview", "tr[data-model='qc']"),
         ("model", "#/model/qc", "#past-rollouts"), ("model-charts", "#/model/qc", "#charts"),
         ("version", "#/model/qc/version/4", "#differences"), ("not-found", "#/model/qcc", "#not-found"),
         ("fleets", "#/fleets", "main table"), ("audit", "#/audit?model=qc", "#audit-body table"))


def test_every_page_reads_at_1440_and_at_390_with_no_broken_word_and_no_sideways_page(
        page: Page, gateway: GatewayThread) -> None:
    """Friction 3: at 390 px the tables broke words letter by letter ('M o d el', 'READ Y')."""
    judged_rollout(gateway)
    expect_diff = page.locator("#audit-body td.changes del, #audit-body td.changes ins")
    kept = os.environ.get("CONSOLE_SCREENSHOTS")
    found: dict[str, list[str]] = {}
    for size, suffix in ((WIDE, "1440"), (PHONE, "390")):
        page.set_viewport_size(size)
        for name, route, ready in PAGES:
            if route is None:
                page.context.clear_cookies()
                page.goto(gateway.url + "/console")
            else:
                if page.locator("#login").is_visible():
                    log_in(page, gateway.url)
                page.goto(gateway.url + "/console" + route)
            expect(page.locator(ready).first).to_be_visible()
            if name == "audit":
                expect(expect_diff.first).to_be_visible()  # before and after shown as a difference
            if name == "model-charts":
                page.locator("#charts").scroll_into_view_if_needed()
                expect(page.locator("#chart-error-rate canvas")).to_have_count(1)
            else:
                page.evaluate("window.scrollTo(0, 0)")
            problems = page.evaluate(LAYOUT)
            if problems:
                found[f"{name} at {suffix}"] = problems
            screenshot(page, f"{name}-{suffix}")
            if kept:  # make screenshots: the whole page (the charts' part as it is scrolled to)
                (ROOT / kept).mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(ROOT / kept / f"{name}-{suffix}.png"), full_page=name != "model-charts")
    assert not found, found
