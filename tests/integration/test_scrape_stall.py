"""A /metrics scrape never stalls inference: the exposition is encoded off the serving loop.

Counted, not timed: the encoder is held mid-scrape (it waits on an event), and inference
requests sent meanwhile must all be answered before it is let go. Rendered on the loop (as
before issue 36: 2.3 s of stopped inference per scrape at 1,000 models, 18 s at 5,000), the
held encoder holds every request with it and none is answered.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator

import prometheus_client.exposition
import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.support import INFER_BODY, TOKEN, GatewayThread, gateway_settings

pytestmark = pytest.mark.triton


def infer(url: str) -> int:
    request = urllib.request.Request(f"{url}/v2/models/qc/infer", data=INFER_BODY, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return int(response.status)


class HeldEncoder:
    """prometheus_client's text encoder, held at its start until :meth:`release`."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()
        self.threads: list[int] = []
        self.real = prometheus_client.exposition.generate_latest

    def __call__(self, registry: object) -> bytes:
        self.threads.append(threading.get_ident())
        self.entered.set()
        self.released.wait(15)
        return bytes(self.real(registry))  # type: ignore[arg-type]

    def release(self) -> None:
        self.released.set()


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldEncoder]:
    encoder = HeldEncoder()
    monkeypatch.setattr(prometheus_client.exposition, "generate_latest", encoder)
    try:
        yield encoder
    finally:
        encoder.release()


def test_inference_is_answered_while_a_scrape_is_being_rendered(triton: LocalTriton, held: HeldEncoder) -> None:
    settings = gateway_settings(triton.http_url, admin_token=TOKEN, policies={"qc": {"weights": {"2": 80, "3": 20}}})
    with GatewayThread(settings) as gw:
        scraped: list[bytes] = []
        scraper = threading.Thread(target=lambda: scraped.append(urllib.request.urlopen(
            f"{gw.url}/metrics", timeout=30).read()), daemon=True)
        scraper.start()
        assert held.entered.wait(10), "the scrape never reached the encoder"
        answered = []
        try:
            for _ in range(20):
                answered.append(infer(gw.url))
        except OSError as exc:  # a timeout: the loop that serves inference waits on the encoder
            pytest.fail(f"inference stalled behind the scrape after {len(answered)} answers: {exc}")
        finally:
            still_held = not held.released.is_set()
            held.release()
            scraper.join(30)
        assert still_held and answered == [200] * 20, "every request was answered while the encoder was held"
        assert scraped and b"gateway_requests_total" in scraped[0]
        assert held.threads and gw._thread.ident not in held.threads, "encoded on a thread of its own"
