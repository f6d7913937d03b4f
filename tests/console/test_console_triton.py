"""The console's evidence from Triton's own view (issue 34), in a real headless Chromium: a canary
slower in compute is shown rolled back with where the difference lies, and each version's queue
and compute per request over time are drawn stacked."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.conftest import Faults
from tests.console.conftest import OPERATOR_TOKEN, Watched, screenshot
from tests.console.test_console import model_page
from tests.support import BackgroundLoad, admin_call, wait_for

pytestmark = pytest.mark.triton


def test_a_canary_slower_in_compute_shows_where_in_triton(watched: Watched, faults: Faults) -> None:
    url = watched.origin
    faults.set("qc", "3", delay_ms=6)
    with BackgroundLoad(url, concurrency=4):
        status, doc = admin_call(url, "POST", "/admin/models/qc/rollout",
                                 {"canary": "3", "steps": [20, 50, 100], "interval_s": 1.5, "latency_warmup_s": 0},
                                 token=OPERATOR_TOKEN)
        assert status == 200, doc
        wait_for(lambda: admin_call(url, "GET", "/admin/models/qc/rollout", token=OPERATOR_TOKEN)[1]["state"]
                 == "rolled_back" or None, 60, what="the rollback")
    page = model_page(watched)
    expect(page.locator("#rollout-state")).to_have_text("rolled_back")
    expect(page.locator("#why")).to_contain_text("(the difference is in the compute)")
    chart = page.locator("#chart-triton")
    drawn = wait_for(lambda: chart.get_attribute("data-drawn") or None, 10, what="the Triton chart drawn")
    series = dict(part.rsplit(":", 1) for part in drawn.split(","))
    assert int(series["canary 3 queue + compute"]) >= 1 and int(series["reference 2 queue"]) >= 1, drawn
    expect(chart.locator("figcaption")).to_contain_text("compute +")
    page.locator("#chart-triton").scroll_into_view_if_needed()
    screenshot(page, "model-triton")
