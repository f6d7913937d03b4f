"""An HTTP request body is copied once on its way in (issue 37), counted in bytes allocated.

An 8 MB body arrives in reads of 64 KB or more and is read whole the way the proxy reads it
(``proxy.limits.BodyReader``). What the gateway allocates meanwhile is counted with tracemalloc,
read by read (each read's peak over what was held before it): the pieces httptools hands over
(one body's worth; they are bytes of the read) and the one join of them. uvicorn's cycle
appended each piece to a bytearray and copied that again into bytes for every ``receive()``:
three copies of the body in all (about 3x its size allocated), and CPU per MB that grew with it.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from typing import Any

import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from gateway.http_front import protocol_for
from gateway.proxy.limits import BodyReader
from gateway.settings import Settings
from tests.unit.test_idle_connections import PeerTransport

MB = 1 << 20
SIZE = 8 * MB


class Reading:
    """An app that reads the body whole as the proxy does, keeps it and answers 200."""

    def __init__(self) -> None:
        self.reader = BodyReader(max_body=2 * SIZE, max_buffered=4 * SIZE)
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        body = message["body"]
        if message.get("more_body"):
            body = await self.reader.read(body, receive, scope["headers"])
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.parametrize("read_size", [64 << 10, 256 << 10 | 3])
async def test_a_body_spread_over_reads_is_copied_once_on_its_way_in(read_size: int) -> None:
    body = bytes(range(256)) * (SIZE // 256)
    wire = b"POST /upload HTTP/1.1\r\nhost: gateway\r\ncontent-length: %d\r\n\r\n" % SIZE + body
    reads = [wire[at:at + read_size] for at in range(0, len(wire), read_size)]
    app = Reading()
    settings = Settings.load(None, max_body_bytes=2 * SIZE)
    config = Config(app=app, lifespan="off", log_level="warning")
    config.load()
    state = ServerState()
    connection = protocol_for(settings)(config=config, server_state=state, app_state={},
                                        _loop=asyncio.get_running_loop())
    connection.connection_made(PeerTransport(1))
    allocated = 0
    tracemalloc.start()
    try:
        for piece in reads:
            tracemalloc.reset_peak()
            held = tracemalloc.get_traced_memory()[0]
            connection.data_received(piece)
            for _ in range(3):  # the app's task takes what came (receive), as it would between two reads
                await asyncio.sleep(0)
            allocated += tracemalloc.get_traced_memory()[1] - held
        await asyncio.wait_for(asyncio.gather(*state.tasks), 30)
    finally:
        tracemalloc.stop()
        connection.connection_lost(None)
    assert app.bodies == [body], "the body arrived whole"
    # the pieces (one body's worth, as httptools hands them) and their one join
    assert allocated < 2.3 * SIZE, f"{allocated / MB:.1f} MB allocated for an 8 MB body: more than one copy"
