"""The lean server's bounds on grpcio's server (``grpc_server: grpcio``), as far as grpcio lets
them be kept (issue 22; what it cannot is in ``gateway/grpc/grpcio_front.py``'s docstring and
the README): a message's size, compressed and inflated; the one byte budget for every message
the handler holds, released on every path; and ``max_connections_per_client`` over the
connections that have calls in flight (grpcio tells Python nothing of idle ones)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import grpc
import grpc.aio
import pytest

from gateway.devtools.local_triton import LocalTriton, free_port
from tests.abuse.attack import (
    DATA,
    END_STREAM,
    MB,
    Attacker,
    frame,
    infer_message,
    request_headers,
)
from tests.abuse.gateway_process import GatewayProcess
from tests.support import GatewayThread, gateway_settings, wait_for

pytestmark = pytest.mark.triton
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
MESSAGE = infer_message()[5:]  # a valid ModelInferRequest for qc, unframed (grpcio frames it)
CAP = 2


def channel(port: int) -> grpc.aio.Channel:
    """A channel of its own: a connection of its own (no subchannel shared with other channels)."""
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1),
                                                                    ("grpc.max_send_message_length", -1)])


async def unary(port: int, message: bytes = MESSAGE,
                compression: grpc.Compression = grpc.Compression.NoCompression) -> tuple[grpc.StatusCode, str]:
    async with channel(port) as opened:
        try:
            await opened.unary_unary(INFER)(message, timeout=30, compression=compression)
        except grpc.aio.AioRpcError as error:
            return error.code(), error.details() or ""
        return grpc.StatusCode.OK, ""


async def streamed(port: int, messages: list[bytes]) -> tuple[grpc.StatusCode, str, int]:
    """A ModelStreamInfer stream of ``messages``: its final status and how many replies came."""
    async with channel(port) as opened:
        call = opened.stream_stream(STREAM)(iter(messages), timeout=30)
        replies = 0
        try:
            async for _ in call:
                replies += 1
        except grpc.aio.AioRpcError as error:
            return error.code(), error.details() or "", replies
        return await call.code(), await call.details() or "", replies


@pytest.fixture
def grpcio_gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    """grpcio's server with a 4 MiB message limit and a 16 MiB budget shared with the HTTP port."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, grpc_server="grpcio",
                                policies={"qc": {"weights": {"2": 100}}}, max_body_bytes=4 * MB,
                                grpc_max_message_bytes=4 * MB, max_buffered_body_bytes=16 * MB,
                                max_connections_per_client=CAP)
    with GatewayThread(settings) as gateway:
        yield gateway


def connections_with_calls(gateway: GatewayThread, address: str = "127.0.0.1") -> int:
    """Read on the gateway's loop: the connections of ``address`` that have calls in flight."""
    async def read() -> int:
        assert gateway.app.grpc is not None
        return len(gateway.app.grpc.callers.calls.get(address, {}))
    return gateway.call(read())  # type: ignore[no-any-return]


def held(gateway: GatewayThread) -> int:
    async def read() -> int:
        return gateway.app.budget.held
    return gateway.call(read())  # type: ignore[no-any-return]


def charge(gateway: GatewayThread, size: int) -> None:
    """Take (or with a negative size give back) budget on the gateway's loop, as another request would."""
    async def take() -> None:
        gateway.app.budget.held += size
    gateway.call(take())


def test_grpcio_messages_are_charged_to_the_budget_and_released_on_every_path(
        grpcio_gateway: GatewayThread) -> None:
    """With all but a few bytes of the budget taken (by other requests, say), a ModelInfer call
    and a stream message are answered UNAVAILABLE in the lean server's words; once the budget is
    free they are served; and the budget is back to 0 after served, malformed, refused and
    cancelled calls. Before: grpcio's calls charged nothing and went on past the budget."""
    port = grpcio_gateway.settings.grpc_port
    assert asyncio.run(unary(port)) == (grpc.StatusCode.OK, "")
    assert held(grpcio_gateway) == 0

    busy = 16 * MB - len(MESSAGE) + 1  # one byte short of room for the message
    charge(grpcio_gateway, busy)
    try:
        words = f"the gateway holds {16 * MB} bytes of requests already: retry shortly"
        assert asyncio.run(unary(port)) == (grpc.StatusCode.UNAVAILABLE, words)
        assert asyncio.run(streamed(port, [MESSAGE])) == (grpc.StatusCode.UNAVAILABLE, words, 0)
        assert held(grpcio_gateway) == busy
    finally:
        charge(grpcio_gateway, -busy)

    assert asyncio.run(streamed(port, [MESSAGE] * 3)) == (grpc.StatusCode.OK, "", 3)
    code, details = asyncio.run(unary(port, b"\xff" * 64))  # malformed: the route raises
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    code, details, _ = asyncio.run(streamed(port, [MESSAGE, b"\xff" * 64]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details

    async def cancelled() -> None:  # the client goes away with a message on a stream
        async with channel(port) as opened:
            call = opened.stream_stream(STREAM)()
            await call.write(MESSAGE)
            await call.read()
            await call.write(MESSAGE)
            call.cancel()

    asyncio.run(cancelled())
    wait_for(lambda: held(grpcio_gateway) == 0, 5, what="the budget back to 0 after every call")


def test_grpcio_connections_with_calls_are_capped_per_address(grpcio_gateway: GatewayThread) -> None:
    """127.0.0.1 holds CAP connections, each with a stream open; a call on its next connection is
    answered UNAVAILABLE naming max_connections_per_client, while 127.0.0.2 is served, and a
    connection whose calls ended frees its slot. Before: grpcio served every connection."""
    port = grpcio_gateway.settings.grpc_port
    holders = [Attacker(port) for _ in range(CAP)]
    for holder in holders:  # a stream in flight on each: HEADERS, no END_STREAM
        holder.send(holder.headers(1, request_headers(STREAM.encode())))
    wait_for(lambda: connections_with_calls(grpcio_gateway) == CAP, 10,
             what=f"{CAP} connections with calls in flight")

    code, details = asyncio.run(unary(port))
    assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
    assert details == (f"this client address has {CAP} gRPC connections open (max_connections_per_client): "
                       "retry shortly")

    other = Attacker(port, source="127.0.0.2")  # another address: served
    other.send(other.headers(1, request_headers()) + frame(DATA, END_STREAM, 1, infer_message()))
    assert other.statuses(1, until=10) == {1: 0}
    other.close()

    holders.pop().close()  # its stream ends with its connection: the slot is free
    wait_for(lambda: connections_with_calls(grpcio_gateway) == CAP - 1, 10,
             what="a closed connection's calls to end")
    assert asyncio.run(unary(port)) == (grpc.StatusCode.OK, "")
    for holder in holders:
        holder.close()
    wait_for(lambda: connections_with_calls(grpcio_gateway) == 0, 10, what="no call counted once all ended")


def test_grpcio_a_message_inflating_past_the_limit_is_refused_with_bounded_memory(triton: LocalTriton) -> None:
    """Four concurrent gzip messages that inflate to 96 MiB each (~100 KB on the wire) against an
    8 MiB message limit: RESOURCE_EXHAUSTED, and the gateway's RSS grows by tens of MB, not by
    the ~400 MB it took when grpcio's receive limit was off (it inflated all four whole)."""
    grpc_port = free_port()
    with GatewayProcess(triton.http_url, triton_grpc_url=triton.grpc_url, grpc_port=grpc_port, grpc_server="grpcio",
                        policies={"qc": {"weights": {"2": 100}}}, max_body_bytes=8 * MB,
                        grpc_max_message_bytes=8 * MB, max_buffered_body_bytes=32 * MB) as gateway:
        peak = [0.0]
        stop = threading.Event()
        pipe = threading.Lock()

        def rss() -> float:
            with pipe:
                return gateway.state().rss_mb

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], rss())
                time.sleep(0.02)

        before = rss()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        async def bombs() -> list[tuple[grpc.StatusCode, str]]:
            zeros = bytes(96 * MB)
            return await asyncio.gather(*(unary(grpc_port, zeros, grpc.Compression.Gzip) for _ in range(4)))

        try:
            answers = asyncio.run(bombs())
        finally:
            stop.set()
            sampler.join(5)
        assert {code for code, _ in answers} == {grpc.StatusCode.RESOURCE_EXHAUSTED}, answers
        grown = peak[0] - before
        assert grown < 150, f"RSS grew by {grown:.0f} MB for messages limited to 8 MiB"
        with pipe:
            assert gateway.state().held == 0



def test_grpcio_closes_silent_and_callless_connections_after_the_ports_timeouts(triton: LocalTriton) -> None:
    """grpc_preface_timeout_s and grpc_idle_timeout_s hold on grpcio's server too (its own defaults
    were 120 s for the handshake and no idle limit at all)."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, grpc_server="grpcio",
                                grpc_preface_timeout_s=1.0, grpc_idle_timeout_s=1.0)
    with GatewayThread(settings) as gateway:
        port = gateway.settings.grpc_port
        silent = Attacker(port, preface=False, timeout=10)
        callless = Attacker(port, timeout=10)
        started = time.monotonic()
        silent.frames(until=10, stop=None)
        assert silent.closed, "a connection that never sent its preface is still open after 10 s"
        callless.frames(until=10, stop=None)
        assert callless.closed, "a connection without calls is still open after 10 s"
        assert time.monotonic() - started < 10
