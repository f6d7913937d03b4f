"""gateway.fleet.reads: one read per server per age bound, whoever asks; an unchanged index is
parsed once; a failed read is not kept."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from gateway.errors import UpstreamError
from gateway.fleet.config import ServerSpec
from gateway.fleet.members import GrpcClient, Server
from tests.scale_triton import ScaleTriton


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class NoGrpc:
    async def aclose(self) -> None:
        pass


def server_for(url: str) -> Server:
    return Server("default", ServerSpec(http=url, grpc="127.0.0.1:1"),
                  grpc_connect=lambda address: cast(GrpcClient, NoGrpc()))


async def test_readers_within_the_age_bound_share_one_read_and_concurrent_ones_one_flight() -> None:
    async with ScaleTriton(100) as triton:
        server = server_for(triton.url)
        clock = Clock()
        server.reads.clock = clock
        try:
            first, second, third = await asyncio.gather(*(server.reads.index(server, 5.0, 1.0) for _ in range(3)))
            assert triton.asked["index"] == 1 and first is second is third
            assert len(first.ready) == 100 and first.ready["m00042"] == frozenset({"1", "2", "3"})
            assert first.states["m00007"]["2"] == ("READY", "")
            clock.now += 0.9
            assert await server.reads.index(server, 5.0, 1.0) is first and triton.asked["index"] == 1
            clock.now += 0.2  # past the bound: read again; the same bytes give the same parsed index
            assert await server.reads.index(server, 5.0, 1.0) is first and triton.asked["index"] == 2
            assert await server.reads.index(server, 5.0, 0.0) is first and triton.asked["index"] == 3
            triton.index = b'[{"name": "m00001", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}]'
            changed = await server.reads.index(server, 5.0, 0.0)
            assert changed is not first and changed.ready == {} and changed.states["m00001"]["1"][0] == "UNAVAILABLE"
            assert server.reads.sent == 4
        finally:
            await server.aclose()


async def test_a_failed_read_reaches_every_waiter_and_is_not_kept() -> None:
    async with ScaleTriton(1) as triton:
        server = server_for(triton.url)
        try:
            triton.index = b'{"not": "a list"}'
            for _ in range(2):
                with pytest.raises(ValueError):
                    await server.reads.index(server, 5.0, 60.0)
            assert triton.asked["index"] == 2
            triton.index = b"[]"
            assert (await server.reads.index(server, 5.0, 60.0)).ready == {}
        finally:
            await server.aclose()
    server = server_for(triton.url)  # nobody listens any more
    try:
        with pytest.raises(UpstreamError):
            await server.reads.index(server, 1.0)
    finally:
        await server.aclose()
