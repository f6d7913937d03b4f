"""Steady inference traffic from clients that do not retry, for the tests that replace
gateway processes under load (worker reloads, rolling updates): every exception and every
answer but 200 / OK is a failure, kept with when it happened."""

from __future__ import annotations

import asyncio
import http.client
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

from gateway.grpc.status import StatusCode
from gateway.grpc.upstream import GrpcUpstream
from tests.fleet_support import INFER, infer_message
from tests.support import INFER_BODY

KINDS = ("fresh", "kept-alive", "grpc")  # the keys of ``ok`` every kind of client counts under


class SteadyLoad:
    """HTTP on a new connection per request (urllib), HTTP on kept-alive connections
    (http.client, which reconnects only after an answer said ``connection: close``: counted
    as "told to close"), and gRPC (the gateway's own HTTP/2 client: it resends only the calls
    a GOAWAY says were never processed, as grpc does)."""

    def __init__(self, url: str, grpc_port: int, threads: int = 3, grpc_clients: int = 3) -> None:
        self.url, self.grpc_port = url, grpc_port
        self.ok: Counter[str] = Counter()
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.started = time.monotonic()
        self.threads = [threading.Thread(target=self._fresh, daemon=True) for _ in range(threads)]
        self.threads += [threading.Thread(target=self._kept_alive, daemon=True) for _ in range(threads)]
        self.threads.append(threading.Thread(target=lambda: asyncio.run(self._grpc(grpc_clients)), daemon=True))

    def _fresh(self) -> None:
        while not self.stop.is_set():
            request = urllib.request.Request(f"{self.url}/v2/models/qc/infer", data=INFER_BODY)
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    response.read()
                    self.ok["fresh"] += 1
            except urllib.error.HTTPError as exc:
                self.failed(f"fresh connection: {exc.code} {exc.read()[:200]!r}")
            except Exception as exc:  # counted: the tests assert there are none
                self.failed(f"fresh connection: {exc!r}")

    def _kept_alive(self) -> None:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        while not self.stop.is_set():
            try:
                connection.request("POST", "/v2/models/qc/infer", INFER_BODY)
                response = connection.getresponse()
                body = response.read()
                if response.status != 200:
                    self.failed(f"kept-alive connection: {response.status} {body[:200]!r}")
                else:
                    self.ok["kept-alive"] += 1
                    if response.will_close:
                        self.ok["told to close"] += 1
            except Exception as exc:  # counted: the tests assert there are none
                self.failed(f"kept-alive connection: {exc!r}")
                connection.close()
        connection.close()

    async def _grpc(self, clients: int) -> None:
        body = infer_message()

        async def calls() -> None:
            client = GrpcUpstream(f"127.0.0.1:{self.grpc_port}")
            while not self.stop.is_set():
                try:
                    code, details, _ = await client.unary(INFER, body, (), 30.0)
                except Exception as exc:  # counted, and the calls go on: the tests assert there are none
                    self.failed(f"grpc: {exc!r}")
                    continue
                if code == StatusCode.OK:
                    self.ok["grpc"] += 1
                else:
                    self.failed(f"grpc: {code} {details}")
            await client.aclose()

        await asyncio.gather(*(calls() for _ in range(clients)))

    def failed(self, what: str) -> None:
        self.failures.append(f"{self.elapsed():.2f} s: {what}")

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def __enter__(self) -> SteadyLoad:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
