"""A gateway in a process of its own, for tests that measure it while generating inputs.

Hypothesis keeps what it generated (~80 KB per example of these requests: 240 MB over 3,000),
so in the test's own process RSS would measure hypothesis rather than the gateway, and the
generator would share the interpreter lock with the server. The child runs a
:class:`GatewayThread` and answers :meth:`GatewayProcess.state` over a pipe: its client
connections from 127.0.0.1, its running request tasks, the body bytes it holds, its RSS.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection
from typing import Any, NamedTuple


class GatewayState(NamedTuple):
    connections: int  # from 127.0.0.1 (the examples' address)
    tasks: int  # requests being handled
    held: int  # body bytes held
    rss_mb: float


def _serve(triton_url: str, values: dict[str, Any], pipe: Connection) -> None:
    from tests.abuse.attack import rss_mb
    from tests.support import GatewayThread, gateway_settings

    with GatewayThread(gateway_settings(triton_url, **values)) as gateway:
        async def read() -> GatewayState:
            per_client: dict[str, int] = gateway.server.config.http.per_client  # type: ignore[union-attr]
            return GatewayState(per_client.get("127.0.0.1", 0), len(gateway.server.server_state.tasks),
                                gateway.app.proxy.bodies.held, 0.0)

        pipe.send(gateway.settings.port)
        while pipe.recv() == "state":
            state: GatewayState = gateway.call(read())
            pipe.send(state._replace(rss_mb=rss_mb()))


class GatewayProcess:
    """``with GatewayProcess(triton.http_url, header_timeout_s=...) as gateway: gateway.port``"""

    def __init__(self, triton_url: str, **values: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self._pipe, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(triton_url, values, child), daemon=True)
        self.port = 0

    def __enter__(self) -> GatewayProcess:
        self._process.start()
        if not self._pipe.poll(60):
            self._process.kill()
            raise RuntimeError("the gateway process did not start")
        self.port = self._pipe.recv()
        return self

    def state(self) -> GatewayState:
        self._pipe.send("state")
        if not self._pipe.poll(10):
            raise AssertionError("the gateway process did not answer within 10 s")
        state: GatewayState = self._pipe.recv()
        return state

    def __exit__(self, *exc: object) -> None:
        self._pipe.send("stop")
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
