"""The console in a real headless Chromium (Debian's, driven by Playwright; never `playwright
install`) against the real gateway and the real Triton. Every page a test opens is watched:
a JavaScript error, a Content-Security-Policy violation or a request to any other origin
fails the test."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, BrowserContext, Page, Playwright, sync_playwright

from gateway.devtools.local_triton import LocalTriton
from tests.support import GatewayThread, gateway_settings

CHROMIUM = "/usr/bin/chromium"
OPERATOR_TOKEN = "operator-token-alice"
VIEWER_TOKEN = "viewer-token-vera"
# without the background-networking flags Chromium's own connections fail at every start on a closed network
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts")) / "console"
WATCH = """
window.__csp = [];
document.addEventListener("securitypolicyviolation",
  (e) => window.__csp.push(e.violatedDirective + " " + e.blockedURI));
"""


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    """Module-scoped: Playwright's sync API keeps an event loop running in the main thread while it
    is open, which would break every asyncio test collected after this package."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} missing: `make test` installs Debian's chromium (apt-get install chromium)")
    with sync_playwright() as running:
        yield running


@pytest.fixture
def console_gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    """qc all on version 2, an operator (alice) and a viewer (vera), a fast controller tick."""
    settings = gateway_settings(triton.http_url, admin_tokens={"alice": OPERATOR_TOKEN},
                                viewer_tokens={"vera": VIEWER_TOKEN}, controller_tick_s=0.2,
                                policies={"qc": {"weights": {"2": 100}}})
    with GatewayThread(settings) as running:
        yield running


@dataclass
class Watched:
    """A browser page and everything that went wrong on it."""

    page: Page
    origin: str
    errors: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        found = list(self.errors)
        try:
            found += [f"CSP violation: {v}" for v in self.page.evaluate("window.__csp || []")]
        except Exception:  # the page is closed or navigating: its listeners reported already
            pass
        return found


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    """One Chromium per module (a start costs ~1 s of the suite's budget each time)."""
    launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    yield launched
    launched.close()


@pytest.fixture
def context(browser: Browser) -> Iterator[BrowserContext]:
    """A fresh browser context for each test: no cookie, storage or cache of another test."""
    made = browser.new_context(viewport={"width": 1280, "height": 800})
    made.add_init_script(WATCH)
    yield made
    made.close()


@pytest.fixture
def watched(context: BrowserContext, console_gateway: GatewayThread) -> Iterator[Watched]:
    page = context.new_page()
    watched = Watched(page, console_gateway.url)
    page.on("pageerror", lambda exc: watched.errors.append(f"JavaScript error: {exc}"))

    def console_message(message: Any) -> None:
        # a refused fetch (401 for a wrong token, 403 for a viewer's forged POST) is logged as
        # "Failed to load resource"; it is the answer under test, not a fault of the page
        if message.type == "error" and not message.text.startswith("Failed to load resource"):
            watched.errors.append(f"console error: {message.text}")

    page.on("console", console_message)
    page.on("request", lambda request: None if request.url.startswith(watched.origin) or request.url.startswith(
        ("data:", "blob:", "about:")) else watched.errors.append(f"request outside the gateway: {request.url}"))
    yield watched
    problems = watched.problems()
    assert not problems, problems


def screenshot(page: Page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=False)
    return path


def keep_as_docs(path: Path) -> None:
    """The README's picture, refreshed by the test run when asked (TEST_UPDATE_DOCS=1)."""
    if os.environ.get("TEST_UPDATE_DOCS") == "1":
        shutil.copy(path, Path(__file__).resolve().parents[2] / "docs" / "console.png")


def dump(path: Path, doc: Any) -> None:
    path.write_text(json.dumps(doc, indent=1))
