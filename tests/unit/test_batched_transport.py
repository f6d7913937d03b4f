"""The write-joining transport both ports use: one ``raw.write()`` (one ``send()``) per loop iteration.

The raw transport here records its calls instead of sending: what is asserted is how many
writes reach the socket's transport and in what order with the close, which a real socket
cannot tell apart (the peer reads joined and separate sends alike).
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.batched_transport import BatchedTransport
from gateway.http_output import CoalescingTransport


class RecordingTransport(asyncio.Transport):
    """Stands in for the socket's transport: records writes, EOF and closes in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bytes]] = []
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.calls.append(("write", bytes(data)))

    def write_eof(self) -> None:
        self.calls.append(("eof", b""))

    def close(self) -> None:
        self.calls.append(("close", b""))
        self.closing = True

    def abort(self) -> None:
        self.calls.append(("abort", b""))
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 0


async def next_turn() -> None:
    await asyncio.sleep(0)  # the flush was scheduled with call_soon before this task's wake-up


def batched(raw: RecordingTransport, closed: list[bool] | None = None) -> BatchedTransport:
    loop = asyncio.get_running_loop()
    if closed is None:
        return BatchedTransport(raw, loop)
    return CoalescingTransport(raw, loop, lambda: closed.append(True))


@pytest.mark.parametrize("front", ["http2", "http"])
async def test_the_writes_of_one_loop_iteration_go_out_in_one_write(front: str) -> None:
    raw = RecordingTransport()
    transport = batched(raw, None if front == "http2" else [])
    transport.write(b"status line + headers\r\n\r\n")
    transport.write(bytearray(b"body"))
    transport.write(memoryview(b"!"))
    assert raw.calls == [], "nothing is sent before the loop's next turn"
    assert transport.get_write_buffer_size() == len(b"status line + headers\r\n\r\nbody!")
    await next_turn()
    assert raw.calls == [("write", b"status line + headers\r\n\r\nbody!")]
    transport.write(b"next iteration")
    await next_turn()
    assert raw.calls[1:] == [("write", b"next iteration")]


async def test_close_and_eof_send_what_is_pending_first_and_abort_drops_it() -> None:
    raw = RecordingTransport()
    transport = batched(raw)
    transport.write(b"GOAWAY")
    transport.write_eof()
    transport.write(b"late")
    transport.close()
    assert raw.calls == [("write", b"GOAWAY"), ("eof", b""), ("write", b"late"), ("close", b"")]
    aborted = RecordingTransport()
    transport = batched(aborted)
    transport.write(b"never sent")
    transport.abort()
    await next_turn()
    assert aborted.calls == [("abort", b"")]


async def test_after_shut_what_was_written_is_out_and_nothing_more_goes() -> None:
    raw = RecordingTransport()
    transport = batched(raw)
    transport.write(b"answer")
    transport.shut()
    assert raw.calls == [("write", b"answer")], "shut sends what is pending at once"
    transport.write(b"window credit")
    await next_turn()
    transport.write_eof()
    assert raw.calls == [("write", b"answer"), ("eof", b"")]


async def test_the_http_fronts_close_is_its_own_after_the_pending_writes() -> None:
    raw = RecordingTransport()
    closed: list[bool] = []
    transport = batched(raw, closed)
    transport.write(b"HTTP/1.1 200 OK\r\n")
    transport.close()
    assert raw.calls == [("write", b"HTTP/1.1 200 OK\r\n")], "the raw transport is the front's to close"
    assert closed == [True]


async def test_a_whole_answer_goes_out_at_once_unless_writes_wait_before_it() -> None:
    """An HTTP answer written whole (``GatewayCycle.answer``) does not wait for the loop's next turn
    (a turn costs an epoll and a callback per request at c=1: 3.05 epoll_pwait per request, 2.18
    after); written behind pending pieces, it keeps its place after them, in the same one write."""
    raw = RecordingTransport()
    transport = batched(raw, [])
    transport.write_now(b"HTTP/1.1 200 OK\r\n\r\nanswer")
    assert raw.calls == [("write", b"HTTP/1.1 200 OK\r\n\r\nanswer")], "sent before the loop's next turn"
    transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    transport.write_now(b"HTTP/1.1 200 OK\r\n\r\nnext")
    assert raw.calls[1:] == [], "behind a pending write: joined with it on the next turn"
    await next_turn()
    assert raw.calls[1:] == [("write", b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\nnext")]
    transport.shut()
    transport.write_now(b"after shut")
    await next_turn()
    assert raw.calls[2:] == [], "nothing goes after shut"
