"""Send one HTTP call to Triton and through the gateway; compare what a client sees."""

from __future__ import annotations

import http.client
import json
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tests.compat.differences import ROUTING_HEADERS, UNCOMPARED_HEADERS


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names, every header but UNCOMPARED_HEADERS (see differences)
    body: bytes
    routing: dict[str, str]  # the gateway's routing headers, if any

    def json(self) -> Any:
        return json.loads(self.body)


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    return parts.hostname or "127.0.0.1", parts.port or 80


def call(url: str, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None, timeout: float = 30) -> Answer:
    host, port = address(url)
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        return answer(connection.getresponse())
    finally:
        connection.close()


def answer(response: http.client.HTTPResponse) -> Answer:
    raw = response.read()
    names = {name.lower(): value for name, value in response.getheaders()}
    compared = {name: value for name, value in names.items() if name not in UNCOMPARED_HEADERS}
    return Answer(response.status, compared, raw, {name: names[name] for name in ROUTING_HEADERS if name in names})


def both(triton_url: str, gateway_url: str, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[Answer, Answer]:
    return call(triton_url, method, path, body, headers), call(gateway_url, method, path, body, headers)


def assert_same(direct: Answer, through: Answer, what: str = "") -> None:
    """Status, the headers (but UNCOMPARED_HEADERS) and the body, byte for byte."""
    assert (through.status, through.headers) == (direct.status, direct.headers), \
        f"{what}: Triton {direct.status} {direct.headers} {direct.body[:300]!r}, " \
        f"gateway {through.status} {through.headers} {through.body[:300]!r}"
    assert through.body == direct.body, f"{what}: Triton {direct.body[:500]!r}\ngateway {through.body[:500]!r}"


def raw_exchange(url: str, payload: bytes, responses: int = 1, timeout: float = 10) -> bytes:
    """Bytes in, bytes out on one connection (pipelining, Expect: 100-continue)."""
    sock = socket.create_connection(address(url), timeout=timeout)
    try:
        sock.sendall(payload)
        data = b""
        while data.count(b"HTTP/1.1 ") < responses or not _complete(data, responses):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data
    finally:
        sock.close()


def _complete(data: bytes, responses: int) -> bool:
    """Every expected response's body is in (content-length framing)."""
    at, seen = 0, 0
    while seen < responses:
        head_end = data.find(b"\r\n\r\n", at)
        if head_end < 0:
            return False
        head = data[at:head_end].lower()
        length = 0
        for line in head.split(b"\r\n"):
            if line.startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        if head.startswith(b"http/1.1 100"):
            at = head_end + 4
            continue
        if len(data) < head_end + 4 + length:
            return False
        at, seen = head_end + 4 + length, seen + 1
    return True


def responses_of(data: bytes) -> list[tuple[int, bytes]]:
    """(status, body) of each response in a raw HTTP/1.1 byte stream, interim 100s included."""
    out, at = [], 0
    while at < len(data):
        head_end = data.find(b"\r\n\r\n", at)
        if head_end < 0:
            break
        head = data[at:head_end]
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.lower().split(b"\r\n"):
            if line.startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        out.append((status, data[head_end + 4:head_end + 4 + length]))
        at = head_end + 4 + length
    return out
