"""A gRPC call alone on its connection does not wait for the loop's next turn to be written (issue 37).

Both HTTP/2 roles join a loop iteration's writes into one ``send()`` on the next turn
(``gateway.batched_transport``), which pays when many calls share a connection. A call alone on
its connection has nothing to join, and waiting cost a loop turn (an epoll and a callback) on
each side of every call at c=1: 4 epoll_pwait per call under strace against Triton, 3.3 after.
Counted here as writes that reached the socket's transport before the loop's next turn.
"""

from __future__ import annotations

import asyncio
import struct

from gateway.grpc.client_connection import Http2Connection
from gateway.grpc.server_connection import GrpcServerConnection
from gateway.http2.endpoint import DATA, END_HEADERS, END_STREAM, HEADERS, PREFACE, SETTINGS, WINDOW_UPDATE, frame
from gateway.http2.hpack_codec import literal, literal_indexed_name
from gateway.http2.server_stream import Limits, ServerStream
from tests.unit.test_message_copies import Keeping

BLOCK = (b"\x83\x86" + literal_indexed_name(4, b"/inference.GRPCInferenceService/ModelInfer")
         + literal_indexed_name(1, b"gw") + literal_indexed_name(31, b"application/grpc")
         + literal(b"te", b"trailers"))


def call(stream_id: int, message: bytes = b"request") -> bytes:
    return (frame(HEADERS, END_HEADERS, stream_id, BLOCK)
            + frame(DATA, END_STREAM, stream_id, b"\x00" + len(message).to_bytes(4, "big") + message))


class Holder:
    """A unary handler that answers nothing by itself: the test answers for it."""

    streaming = False
    streams: list[ServerStream] = []

    def __init__(self, connection: GrpcServerConnection, stream: ServerStream) -> None:
        Holder.streams.append(stream)

    def on_message(self, message: bytes | bytearray) -> None:
        pass

    def on_end(self) -> None:
        pass

    def on_reset(self) -> None:
        pass

    def on_sent(self) -> None:
        pass


async def test_an_answer_alone_on_its_connection_goes_out_before_the_next_turn() -> None:
    Holder.streams = []
    connection = GrpcServerConnection(Holder, set(), Limits())
    transport = Keeping()
    connection.connection_made(transport)
    connection.data_received(PREFACE + frame(SETTINGS, 0, 0) + call(1))
    await asyncio.sleep(0)  # our SETTINGS and the ACK go out
    transport.pieces.clear()
    connection.reply(Holder.streams[0], b"answer")
    assert transport.pieces, "the one call's answer went out at once"
    # two calls open on one connection: the first answer waits to be joined with what else this turn writes
    connection.data_received(call(3) + call(5))
    await asyncio.sleep(0)
    transport.pieces.clear()
    connection.reply(Holder.streams[1], b"answer")
    assert transport.pieces == [], "another call is open: joined on the loop's next turn"
    connection.reply(Holder.streams[2], b"answer")
    await asyncio.sleep(0)
    assert len(transport.pieces) == 1, "both answers in one write"
    connection.connection_lost(None)


async def test_a_request_alone_on_its_upstream_connection_goes_out_before_the_next_turn() -> None:
    connection = Http2Connection(asyncio.get_running_loop().create_future(), keepalive_s=0)
    transport = Keeping()
    connection.connection_made(transport)
    connection.data_received(frame(SETTINGS, 0, 0) + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 20)))
    await asyncio.sleep(0)  # the preface and the SETTINGS ACK go out
    transport.pieces.clear()
    first = connection.start(b"\x83\x86", b"request")
    assert transport.pieces, "the one call's request went out at once"
    transport.pieces.clear()
    second = connection.start(b"\x83\x86", b"request")
    assert transport.pieces == [], "another call is open: joined on the loop's next turn"
    await asyncio.sleep(0)
    assert len(transport.pieces) == 1
    for started in (first, second):
        started.future.cancel()  # type: ignore[union-attr]
    connection.connection_lost(None)
