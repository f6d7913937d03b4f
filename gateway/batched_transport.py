"""A connection's transport whose writes of one event-loop iteration go out in one ``send()``.

A loopback ``send()`` costs as much as the rest of a proxied call (the kernel delivers to the
peer inside it). Both ports write in pieces: uvicorn writes an HTTP answer's status line and
headers apart from its body, and one HTTP/2 connection carries every call's stream (32 calls
whose requests are written in one iteration were 32 syscalls, now one). So the pieces are
kept until the loop's next turn and joined there.

The HTTP/2 endpoint (both its roles) uses :class:`BatchedTransport` as it is; the HTTP front
(``gateway.http_output.CoalescingTransport``) puts its own close on top. Neither front nor
HTTP/2 is imported here (``tests/unit/test_architecture.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any

Data = bytes | bytearray | memoryview
JOIN_BELOW = 64 << 10  # pending bytes under which the pieces are joined

class BatchedTransport(asyncio.Transport):
    """``raw``, but the writes of one loop iteration are joined into one ``raw.write()`` on the
    loop's next turn. ``close`` and ``write_eof`` send what is pending first; ``abort`` drops it.
    After :meth:`shut` (a lingering close) nothing written goes out."""

    __slots__ = ("raw", "_loop", "_pending", "_size", "shut_down")

    def __init__(self, raw: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.raw = raw
        self._loop = loop
        self._pending: list[Data] | None = None
        self._size = 0  # bytes pending
        self.shut_down = False  # see shut

    def write(self, data: Data) -> None:
        if self.shut_down:
            return
        pending = self._pending
        if pending is None:
            self._pending = [data]
            self._size = len(data)
            self._loop.call_soon(self.flush)
        else:
            pending.append(data)
            self._size += len(data)

    def write_now(self, data: Data, body: Data | None = None) -> None:
        """A whole answer: sent at once when nothing of this iteration waits before it (one
        ``send()`` either way; joining it on the loop's next turn would cost that turn, an epoll
        and a callback, and nothing would join it on an HTTP/1.1 connection), else after what waits.
        ``body``: a large one after ``data`` (its head), written as it is (one writev, no join)."""
        if self._pending is None and not self.shut_down:
            if not self.raw.is_closing():
                if body is None:
                    self.raw.write(data)
                else:
                    self.raw.writelines((data, body))
        else:
            self.write(data)
            if body is not None:
                self.write(body)

    def flush(self) -> None:
        """Small pieces are joined into one ``write`` (a copy of a few KB is cheaper than a vector of
        them); large ones go in one ``writelines`` (uvloop writes them with one writev, the pieces
        as they are: a large message's views are never joined here)."""
        pending, self._pending = self._pending, None
        if pending and not self.raw.is_closing():
            if len(pending) == 1:
                self.raw.write(pending[0])
            elif self._size < JOIN_BELOW:
                self.raw.write(b"".join(pending))
            else:
                self.raw.writelines(pending)

    def shut(self) -> None:
        """What was written goes out now, and nothing written after: the connection is in a
        lingering close (the caller sends its FIN and drops what the peer still sends)."""
        self.flush()
        self.shut_down = True

    def close(self) -> None:
        self.flush()
        self.raw.close()

    def write_eof(self) -> None:
        self.flush()
        self.raw.write_eof()

    def abort(self) -> None:
        self._pending = None
        self.raw.abort()

    def is_closing(self) -> bool:
        return self.raw.is_closing()

    def can_write_eof(self) -> bool:
        return self.raw.can_write_eof()

    def pause_reading(self) -> None:
        self.raw.pause_reading()

    def resume_reading(self) -> None:
        self.raw.resume_reading()

    def is_reading(self) -> bool:
        return self.raw.is_reading()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.raw.get_extra_info(name, default)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.raw.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self.raw.get_write_buffer_size() + (self._size if self._pending else 0)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.raw.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.raw.get_protocol()
