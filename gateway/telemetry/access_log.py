"""Structured access log, written off the hot path.

The proxy appends one small tuple per request to a list (no formatting, no I/O); a
background task turns the batch into JSON lines and writes them in one call every
``flush_s``. Bounded: past ``max_pending`` lines the oldest are dropped and counted, so a
stalled stdout can slow nothing but the log.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import IO, Any

from gateway.background import Background

_LINE = ('{"ts":%.6f,"type":"access","model":%s,"version":"%s","route":"%s","protocol":"%s","status":%s,'
         '"latency_ms":%.3f}')


class AccessLog:
    def __init__(self, stream: IO[str] | None = None, flush_s: float = 0.5, max_pending: int = 100_000) -> None:
        self.stream = stream or sys.stdout
        self.flush_s = flush_s
        self.max_pending = max_pending
        self.dropped = 0
        self._pending: list[tuple[Any, ...]] = []
        self._background = Background()
        self._quoted: dict[str, str] = {}

    def __call__(self, model: str, version: str | None, route: str, protocol: str, status: int | str,
                 latency_s: float) -> None:
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            return
        self._pending.append((time.time(), model, version, route, protocol, status, latency_s))

    def start(self) -> None:
        self._background.spawn(self._run())

    async def stop(self) -> None:
        await self._background.cancel_all()
        self.flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            self.flush()

    def flush(self) -> None:
        batch, self._pending = self._pending, []
        if not batch:
            return
        quoted = self._quoted
        lines = []
        for ts, model, version, route, protocol, status, latency in batch:
            name = quoted.get(model)
            if name is None:  # client-chosen text: escape once per distinct name
                name = json.dumps(model)
                if len(quoted) < 10_000:
                    quoted[model] = name
            # version, route, protocol and status are digits or fixed words: no escaping needed
            lines.append(_LINE % (ts, name, version or "", route, protocol, json.dumps(status), latency * 1000))
        self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()
