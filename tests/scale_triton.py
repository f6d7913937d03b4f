"""A Triton stand-in of N models for the scale tests, counting what it is asked.

Why not the real Triton: the tests of issue 36 need repositories of hundreds to thousands of
models and 50 rollouts, and a real Triton here runs each of the sample repository's Python-
backend models as a process of its own; a repository that size cannot be started on these
machines. What the tests count is what the gateway asks (requests by kind); the answers have
Triton's shapes as the real server gives them (docs/triton-protocol.md, tests/integration): the
repository index, per-version readiness (200, else 400), model configs, inference.

It runs on the test's own event loop (``async with ScaleTriton(500) as triton``).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Self

from gateway.devtools.local_triton import free_port

VERSIONS = ("1", "2", "3")


def names(count: int) -> list[str]:
    return [f"m{index:05d}" for index in range(count)]


class ScaleTriton:
    def __init__(self, models: int) -> None:
        self.models = names(models)
        self.known = set(self.models)
        self.index = json.dumps([{"name": name, "version": version, "state": "READY"}
                                 for name in self.models for version in VERSIONS]).encode()
        self.asked: Counter[str] = Counter()  # kind -> requests: index, ready, config, health, infer, stats, other
        self.stats_of: Counter[str] = Counter()  # model -> statistics reads
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path = head.split(b" ", 2)[:2]
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if length:
                    await reader.readexactly(length)
                status, body = self.answer(method.decode(), path.decode())
                writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                             % (status, len(body)) + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def answer(self, method: str, path: str) -> tuple[int, bytes]:
        parts = path.split("?")[0].split("/")
        if path.startswith("/v2/repository/index"):
            self.asked["index"] += 1
            return 200, self.index
        if path.startswith("/v2/health/"):
            self.asked["health"] += 1
            return 200, b""
        if len(parts) >= 4 and parts[1:3] == ["v2", "models"]:
            model = parts[3]
            kind = parts[-1]
            if kind == "ready":
                self.asked["ready"] += 1
                version_ok = len(parts) < 7 or parts[5] in VERSIONS
                return (200, b"") if model in self.known and version_ok else (400, b'{"error":"not ready"}')
            if kind == "config":
                self.asked["config"] += 1
                return 200, json.dumps({"name": model, "max_batch_size": 0}).encode()
            if kind == "infer":
                self.asked["infer"] += 1
                return 200, json.dumps({"model_name": model, "outputs": []}).encode()
            if kind == "stats":  # the statistics extension, every version of the model (issue 34's reader)
                self.asked["stats"] += 1
                self.stats_of[model] += 1
                return 200, json.dumps({"model_stats": [_stats(model, version) for version in VERSIONS]}).encode()
        self.asked["other"] += 1
        return 200, b"{}"


def _stats(model: str, version: str) -> dict[str, object]:
    """One model_stats entry as Triton 2.51 shapes it, all zero."""
    zero = {"count": 0, "ns": 0}
    return {"name": model, "version": version, "last_inference": 0, "inference_count": 0, "execution_count": 0,
            "inference_stats": {name: zero for name in ("success", "fail", "queue", "compute_input", "compute_infer",
                                                        "compute_output", "cache_hit", "cache_miss")},
            "response_stats": {}, "batch_stats": [], "memory_usage": []}
