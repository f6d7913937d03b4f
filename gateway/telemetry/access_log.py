"""Structured access log, written off the hot path.

The proxy appends one small tuple per request to a list (no formatting, no I/O); every
``flush_s`` a background task hands the batch to a worker thread, which turns it into JSON
lines and writes them in one call, so a slow stdout never blocks the event loop. Bounded:
past ``max_pending`` lines the newest are dropped and counted, so a stalled stdout can slow
nothing but the log. Every client-chosen string (model, version) is JSON-escaped: a version
sent as ``1%22%0A{...}`` cannot forge a line. ``server`` names the fleet's server that answered
(its HTTP host:port, the last one tried; "" when the request went to none), as the exchange
carried it: the log says where a request went without asking the fleet again.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import IO, Any

from gateway.background import Background

_LINE = ('{"ts":%.6f,"type":"access","model":%s,"version":%s,"route":"%s","protocol":"%s","status":%s,'
         '"latency_ms":%.3f,"server":%s}')
_QUOTED_MAX = 10_000  # escaped strings remembered (client-chosen: bounded)


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
                 latency_s: float, server: str = "") -> None:
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            return
        self._pending.append((time.time(), model, version, route, protocol, status, latency_s, server))

    def start(self) -> None:
        self._background.spawn(self._run())

    async def stop(self) -> None:
        await self._background.cancel_all()
        self.flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            batch, self._pending = self._pending, []
            if batch:
                await asyncio.to_thread(self._write, batch)  # one batch at a time: lines stay in order

    def flush(self) -> None:
        """Write what is pending now, in the caller's thread (at shutdown)."""
        batch, self._pending = self._pending, []
        if batch:
            self._write(batch)

    def _write(self, batch: list[tuple[Any, ...]]) -> None:
        quoted = self._quoted
        lines = []
        for ts, model, version, route, protocol, status, latency, server in batch:
            name = quoted.get(model)
            if name is None:  # client-chosen text: escaped once per distinct string
                name = _quote(quoted, model)
            chosen = quoted.get(version) if version else '""'
            if chosen is None:
                chosen = _quote(quoted, version)
            where = quoted.get(server) if server else '""'  # configured or discovered: escaped all the same
            if where is None:
                where = _quote(quoted, server)
            # route, protocol and status are fixed words or numbers of our own
            lines.append(_LINE % (ts, name, chosen, route, protocol, json.dumps(status), latency * 1000, where))
        self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()


def _quote(quoted: dict[str, str], text: str) -> str:
    escaped = json.dumps(text)
    if len(quoted) < _QUOTED_MAX:
        quoted[text] = escaped
    return escaped
