"""The channel between the supervisor's control plane and one worker: a Unix socket carrying
length-prefixed pickled tuples ``(kind, *fields)``, both ways.

Both ends are this package's own processes (started by the supervisor, spawn context), so
pickle carries the policy specs and deltas as they are. Worker to control plane: ``hello``,
``delta`` (every ``REPORT_S``: the recorder's delta, the event loop's lag, the policy
push it runs, the sequence pins it touched), ``pins`` (sequence-pin calls, answered at once),
``auth_failed`` (a wrong token on a data port: the control plane counts it). Control plane to
worker: ``policies`` (a snapshot of the policy book, by push number, with the versions the
rollouts watch), ``pinned`` (answers), ``drain``, ``locked`` (a client locked out for wrong
tokens, until a monotonic time).
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
import time
from typing import Any

REPORT_S = 0.25  # a worker reports at least this often: the judge and /metrics lag by at most this
_HEADER = struct.Struct("!I")
MAX_MESSAGE = 64 << 20


class ChannelClosed(ConnectionError):
    pass


def pack(message: tuple[Any, ...]) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


class Channel:
    """One end of a channel over asyncio streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decode_s = 0.0  # CPU spent unpickling what came in: the control plane's cost, for the benchmark

    @classmethod
    async def connect(cls, path: str) -> Channel:
        reader, writer = await asyncio.open_unix_connection(path, limit=MAX_MESSAGE)
        return cls(reader, writer)

    def send(self, *message: Any) -> None:
        if self.writer.is_closing():
            raise ChannelClosed("channel closed")
        self.writer.write(pack(message))

    async def receive(self) -> tuple[Any, ...]:
        try:
            header = await self.reader.readexactly(_HEADER.size)
            (size,) = _HEADER.unpack(header)
            if size > MAX_MESSAGE:
                raise ChannelClosed(f"message of {size} bytes on the channel")
            body = await self.reader.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise ChannelClosed(str(exc)) from exc
        started = time.perf_counter()
        message: tuple[Any, ...] = pickle.loads(body)
        self.decode_s += time.perf_counter() - started
        return message

    def close(self) -> None:
        self.writer.close()


class BlockingChannel:
    """A worker's synchronous line to the control plane, for the calls the request path must
    have answered before it goes on (sequence pins: see gateway.workers.pins)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)

    def call(self, *message: Any) -> Any:
        self.sock.sendall(pack(message))
        header = self._exactly(_HEADER.size)
        (size,) = _HEADER.unpack(header)
        return pickle.loads(self._exactly(size))

    def _exactly(self, size: int) -> bytes:
        chunks, left = [], size
        while left:
            chunk = self.sock.recv(left)
            if not chunk:
                raise ChannelClosed("control plane closed the pin channel")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        self.sock.close()
