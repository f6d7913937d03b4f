"""Attacking clients for the HTTP port, run in a process of their own (:class:`Attack`).

In the test's own process the attackers would share the interpreter lock with the gateway,
which runs there in a thread, and a bystander's latency would measure the attackers' Python
rather than the gateway. A real attacker is elsewhere; so are these. This module imports no
gateway code, so the child process starts quickly.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
import zlib
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

MB = 1 << 20
HEAD = b"POST /v2/models/qc/infer HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
Answer = tuple[int, dict[str, str], Any]


class Attack:
    """``with Attack(slowloris, port, ...) as attack: ... attack.result()``: the attack runs in a
    fresh (spawned) process, bounded by ``timeout`` seconds."""

    def __init__(self, attack: Callable[..., Coroutine[Any, Any, Any]], *args: Any, timeout: float = 20) -> None:
        self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        self._timeout = timeout
        self._future: Future[Any] = self._pool.submit(_run, attack, args, timeout)

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> Any:
        return self._future.result(self._timeout + 30)  # + the child's start

    def __enter__(self) -> Attack:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _run(attack: Callable[..., Coroutine[Any, Any, Any]], args: tuple[Any, ...], timeout: float) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(attack(*args), timeout)

    return asyncio.run(bounded())


async def read_answer(reader: asyncio.StreamReader, timeout: float) -> Answer:
    """One HTTP/1.1 answer: status, headers, JSON body (None when empty)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), timeout)
    return int(lines[0].split()[1]), headers, json.loads(body) if body else None


async def exchange(port: int, request: bytes) -> Answer:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        return await read_answer(reader, 5)
    finally:
        writer.close()


SLOW_HEAD = HEAD[:40]  # a slowloris talker's unfinished head: 40 bytes, one every 0.25 s (10 s)


class _Talker(asyncio.Protocol):
    """A slowloris connection's receiving side. What the gateway sent is kept even when a
    later write of ours fails (a StreamReader raises that write's error before the answer it
    holds: a talker that lagged past the gateway's lingering close lost its 408 so)."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.lost = False
        self.changed = asyncio.Event()

    def data_received(self, data: bytes) -> None:
        self.received += data
        self.changed.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.changed.set()

    async def answer(self, timeout: float) -> tuple[int, dict[str, str], Any]:
        """The gateway's answer: status, headers, JSON body."""
        async with asyncio.timeout(timeout):
            while True:
                head, found, body = bytes(self.received).partition(b"\r\n\r\n")
                if found:
                    lines = head.decode("latin-1").split("\r\n")
                    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
                    length = int(headers.get("content-length", "0"))
                    if len(body) >= length:
                        return int(lines[0].split()[1]), headers, json.loads(body[:length]) if length else None
                if self.lost:
                    raise ConnectionError(f"closed after {bytes(self.received)!r}")
                self.changed.clear()
                await self.changed.wait()


async def slowloris(port: int, talkers: int, silent: int) -> list[tuple[int, str, int, float]]:
    """``talkers`` connections send :data:`SLOW_HEAD` a byte every 0.25 s, until answered;
    ``silent`` ones send nothing. Each: (status, error, bytes sent before the answer came,
    seconds until it was read). A talker sends no byte once any of the answer has arrived."""
    loop = asyncio.get_running_loop()

    async def one(bytes_to_send: bytes) -> tuple[int, str, int, float]:
        transport, talker = await loop.create_connection(_Talker, "127.0.0.1", port)
        started = time.monotonic()
        sent = 0
        try:
            for byte in bytes_to_send:
                if talker.received or talker.lost:
                    break
                transport.write(bytes([byte]))
                sent += 1
                await asyncio.sleep(0.25)
            status, _, body = await talker.answer(6)
            return status, body["error"], sent, time.monotonic() - started
        finally:
            transport.close()

    return list(await asyncio.gather(*(one(SLOW_HEAD) for _ in range(talkers)), *(one(b"") for _ in range(silent))))


async def trickling_bodies(port: int, clients: int) -> list[tuple[int, str]]:
    """Each client announces a 1 MB body and sends a byte every 0.3 s for 2.4 s (under a 1 s idle
    bound each time), then stalls. Each: (status, error) of the answer to the stall."""

    async def one() -> tuple[int, str]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answer = asyncio.ensure_future(read_answer(reader, 6))
        try:
            writer.write(HEAD + b"content-length: 1000000\r\n\r\n")
            for _ in range(8):
                if answer.done():
                    raise AssertionError(f"answered while the body was still coming: {answer.result()}")
                writer.write(b"{")
                await asyncio.sleep(0.3)
            status, _, body = await answer
            return status, body["error"]
        finally:
            writer.close()

    return list(await asyncio.gather(*(one() for _ in range(clients))))


async def huge_announcements(port: int, clients: int) -> list[tuple[int, str, bool]]:
    """Each client announces Content-Length 1000000000 and starts sending. Each: (status, error,
    whether the gateway closed the connection after answering)."""

    async def one() -> tuple[int, str, bool]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(HEAD + b"content-length: 1000000000\r\n\r\n{")
            status, _, body = await read_answer(reader, 5)
            return status, body["error"], await asyncio.wait_for(reader.read(1), 5) == b""
        finally:
            writer.close()

    return list(await asyncio.gather(*(one() for _ in range(clients))))


async def connection_flood(port: int, holders: int, extra: int, request: bytes) -> list[Answer]:
    """``holders`` connections begin a request and never finish it; then ``extra`` connections
    each send ``request``. Their answers."""
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(holders)]
    try:
        for _, writer in held:
            writer.write(HEAD[:20])
        await asyncio.sleep(0.2)
        return [await exchange(port, request) for _ in range(extra)]
    finally:
        for _, writer in held:
            writer.close()


def gzip_bomb(head: bytes, spaces: int, tail: bytes) -> bytes:
    """``head + b" " * spaces + tail``, gzip-compressed piece by piece (never whole in memory)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: gzip framing
    chunk = b" " * MB
    pieces = [packer.compress(head)] + [packer.compress(chunk) for _ in range(spaces // MB)]
    return b"".join([*pieces, packer.compress(tail), packer.flush()])


async def gzip_bombs(port: int, times: int, megabytes: int) -> list[tuple[int, str, int]]:
    """A sequence request whose gzip body inflates to ``megabytes`` MB, sent ``times`` times, one
    after another. Each: (status, error, bytes on the wire)."""
    bomb = gzip_bomb(b'{"parameters": {"sequence_id": 7, "x": "', megabytes * MB, b'"}}')
    request = HEAD + b"content-encoding: gzip\r\ncontent-length: %d\r\n\r\n%s" % (len(bomb), bomb)
    answers = []
    for _ in range(times):
        status, _, body = await exchange(port, request)
        answers.append((status, body["error"], len(bomb)))
    return answers
