"""The upstream pool when Triton closes a kept-alive connection without answering (gateway/upstream.py).

Why: a flaky 502 in tests/abuse/test_headers.py (an 8,000-byte query string) was Triton closing
the connection after reading the request, without a byte of an answer. Its cause turned out to be
Triton's own parser (libevhtp reads one byte past a 4 KB socket read that ends inside the URL),
which a resend does not cure (the stale byte is the same the second time); what these tests pin is
the pool's side of any such close: a request Triton closed on unanswered is sent once more when
that is safe, and a connection Triton closed as it answered is not handed on. A real Triton cannot
be made to close at a chosen moment, so they use a fake upstream: it reads each request whole and
then answers, closes (FIN or reset) as Triton did, or answers and hangs up at once.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator

import pytest
import uvloop

from gateway.errors import UpstreamError, UpstreamUnavailable
from gateway.upstream import HttpUpstream

ANSWER = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'
LONG_URL = b"/v2/models/qc/infer?pad=" + b"p" * 8000  # the test's request that got the 502
BODY = b'{"inputs":[]}'


class DroppingTriton:
    """A fake Triton. ``script``: what it does with the n-th request it reads (then it answers):
    "answer"; "close" (FIN, no answer); "reset" (RST, no answer); "partial" (half a status line,
    then FIN); "answer+close" (answers, then closes at once); "vanish" (stops listening, then FIN)."""

    def __init__(self, *script: str, max_connections: int = 128) -> None:
        self.script = list(script)
        self.max_connections = max_connections
        self.pool: HttpUpstream | None = None  # the pool under test, on this fake
        self.requests: list[tuple[int, bytes]] = []  # (connection number from 1, request line)
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> DroppingTriton:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        self.pool = HttpUpstream(f"http://127.0.0.1:{self.port}", max_connections=self.max_connections,
                                 request_timeout_s=3)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.pool is not None:
            await self.pool.aclose()
        if self.server is not None and self.server.is_serving():
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                self.requests.append((number, head.split(b"\r\n")[0]))
                action = self.script.pop(0) if self.script else "answer"
                if action == "reset":
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                if action == "vanish":
                    assert self.server is not None
                    self.server.close()
                if action in ("close", "vanish"):
                    return
                writer.write(b"HTTP/1.1 2" if action == "partial" else ANSWER)
                await writer.drain()
                if action != "answer":
                    return
        finally:
            writer.close()


async def infer(triton: DroppingTriton, body: bytes | AsyncIterator[bytes] = BODY) -> bytes:
    """One POST of the test's long URL through the pool under test; the answer's body."""
    assert triton.pool is not None
    response = await triton.pool.request(b"POST", LONG_URL, [(b"content-type", b"application/json")], body,
                                         content_length=len(BODY) if not isinstance(body, bytes) else None)
    return await response.read()


async def stream() -> AsyncIterator[bytes]:
    """The body streamed: consumed as it is sent."""
    yield BODY


@pytest.mark.parametrize("drop", ["close", "reset"])
async def test_a_post_triton_dropped_unanswered_on_a_kept_alive_connection_goes_once_more(drop: str) -> None:
    """The second POST on a kept-alive connection is read by Triton, which closes the connection
    without answering (as in the flaky 502). The pool sends it again, on a new connection, and
    the caller gets the answer (before: UpstreamError, a 502)."""
    async with DroppingTriton("answer", drop) as triton:
        assert await infer(triton) == b'{"ok":true}'
        assert await infer(triton) == b'{"ok":true}'
    assert [number for number, _ in triton.requests] == [1, 1, 2], "kept alive, dropped, then a new connection"
    assert {line for _, line in triton.requests} == {b"POST " + LONG_URL + b" HTTP/1.1"}


async def test_a_drop_on_a_fresh_connection_is_not_resent() -> None:
    """A new connection closed unanswered is no idle-close race: the caller gets the error."""
    async with DroppingTriton("close") as triton:
        with pytest.raises(UpstreamError, match="closed the connection"):
            await infer(triton)
    assert len(triton.requests) == 1


async def test_the_resend_is_not_on_another_connection_that_sat_idle() -> None:
    """Idle connections sat as long as the dropped one: the resend opens a new one."""
    async with DroppingTriton("answer", "answer", "close") as triton:
        await asyncio.gather(infer(triton), infer(triton))  # two connections, both idle afterwards
        assert await infer(triton) == b'{"ok":true}'
    assert triton.connections == 3 and triton.requests[-1][0] == 3, triton.requests


async def test_a_request_is_sent_at_most_twice() -> None:
    """Dropped again on the new connection: the caller gets the error; Triton read it twice."""
    async with DroppingTriton("answer", "close", "close") as triton:
        await infer(triton)
        with pytest.raises(UpstreamError, match="closed the connection before the response ended"):
            await infer(triton)
    assert len(triton.requests) == 3  # the first request, then the dropped one twice


async def test_no_resend_once_a_byte_of_the_answer_came_back() -> None:
    """Half a status line means Triton was answering: it ran the request; it is not sent again."""
    async with DroppingTriton("answer", "partial") as triton:
        await infer(triton)
        with pytest.raises(UpstreamError):
            await infer(triton)
    assert len(triton.requests) == 2


async def test_no_resend_of_a_streamed_body() -> None:
    """A streamed body is consumed as it goes: nothing to send again."""
    async with DroppingTriton("answer", "close") as triton:
        await infer(triton)
        with pytest.raises(UpstreamError, match="closed the connection"):
            await infer(triton, stream())
    assert len(triton.requests) == 2


@pytest.mark.parametrize("method", [b"POST", b"GET"])
async def test_a_triton_gone_after_the_drop_gives_a_post_the_first_error_not_unavailable(method: bytes) -> None:
    """Nobody listens for the resend (Triton's process died with the request): a POST gets the
    drop, not UpstreamUnavailable, which a fleet would send on to another server; a GET may go."""
    async with DroppingTriton("answer", "vanish") as triton:
        assert triton.pool is not None
        await infer(triton)
        with pytest.raises(UpstreamError, match="closed the connection|unreachable") as raised:
            await triton.pool.request(method, LONG_URL, [], BODY)
    assert isinstance(raised.value, UpstreamUnavailable) == (method == b"GET") and len(triton.requests) == 2


def test_a_waiter_is_not_handed_a_connection_triton_closed_right_after_answering() -> None:
    """One connection allowed, two requests: the second (its body streamed, so never resent)
    waits for the first's connection, and Triton answers (keep-alive) and closes at once. Under
    uvloop (the gateway's loop) the close is read in the loop's poll after the answer's: the
    connection is handed to the waiter as it closes. The waiter takes a new connection (before: it
    wrote on the dying one and got a 502 for a request Triton never saw)."""
    async def scenario() -> list[bytes]:
        async with DroppingTriton("answer+close", max_connections=1) as triton:
            answers = list(await asyncio.gather(infer(triton), infer(triton, stream())))
        assert [number for number, _ in triton.requests] == [1, 2]
        return answers

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(scenario()) == [b"{\"ok\":true}"] * 2
