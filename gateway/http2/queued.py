"""DATA bytes a stream has to send that wait for the peer's flow-control window (``Queued``).

Large parts are kept as views of what was given to send, never copied. Small ones (below
``JOIN_BELOW``: token replies of ~75 bytes, each already joined once into its own ``bytes``
by ``Endpoint.send``) are appended to one buffer: kept as an object each, with a view and a
deque slot, 64 held streams of 4,000 tokens parked 18 MiB of bytes in 102 MB of RSS; what a
stream may park is bounded in bytes (``server_stream.Limits``), so its memory must follow its bytes.
"""

from __future__ import annotations

from collections import deque

Data = bytes | bytearray | memoryview
# Given to send: one buffer, or the parts of one (a gRPC prefix, a message, a field after it) sent
# as they are, never joined into one when large.
Payload = Data | tuple[Data, ...]
JOIN_BELOW = 16 << 10  # smaller payloads are joined into one write; larger ones go out as views of their parts


class Queued:
    """DATA bytes waiting for flow-control window, in order: views of large parts, small ones
    copied into one buffer (``tail``) until the next take. ``len()`` is the bytes waiting."""

    __slots__ = ("parts", "tail", "size")

    def __init__(self) -> None:
        self.parts: deque[memoryview] = deque()
        self.tail: bytearray | None = None  # small parts after the last of ``parts``: no view of it exists yet
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def add(self, data: Payload) -> None:
        for part in data if isinstance(data, tuple) else (data,):
            size = len(part)
            if not size:
                continue
            self.size += size
            if size < JOIN_BELOW:
                if self.tail is None:
                    self.tail = bytearray(part)
                else:
                    self.tail += part
                continue
            self._seal()
            self.parts.append(part if isinstance(part, memoryview) else memoryview(part))

    def _seal(self) -> None:
        """The tail becomes a part: a view of it is handed out next, so it is never grown again."""
        if self.tail is not None:
            self.parts.append(memoryview(self.tail))
            self.tail = None

    def take(self, count: int) -> list[memoryview]:
        """The first ``count`` bytes, as views (taken out of the queue)."""
        self._seal()
        self.size -= count
        parts, taken = self.parts, []
        while count:
            part = parts[0]
            if len(part) <= count:
                taken.append(parts.popleft())
                count -= len(part)
            else:
                taken.append(part[:count])
                parts[0] = part[count:]
                count = 0
        return taken
