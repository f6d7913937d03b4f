"""Header attacks: the HPACK bomb, header lists past SETTINGS_MAX_HEADER_LIST_SIZE, and the HTTP
port's request heads past max_url_bytes, max_header_bytes and max_header_count."""

from __future__ import annotations

import json
import select
import socket
from collections.abc import Iterator

import pytest

from gateway.devtools.local_triton import LocalTriton
from gateway.proxy.limits import TRITON_MAX_TARGET
from tests.abuse.attack import (
    CONTINUATION,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    HEADERS,
    Attacker,
    frame,
    infer_message,
    request_headers,
    watch,
)
from tests.support import INFER_BODY, GatewayThread, gateway_settings

pytestmark = pytest.mark.triton
RESOURCE_EXHAUSTED = 8


def bomb(attacker: Attacker, references: int) -> bytes:
    """A request whose one 4 KB header is added to the HPACK table once, then referenced ``references`` times
    (4,000 bytes: the entry must fit the 4,096-byte table to stay in it)."""
    head = attacker.block(request_headers() + [(b"x-big", b"b" * 4000)])  # the encoder indexes it: newest entry
    return head + b"\xbe" * references  # 0xbe: dynamic index 62, the newest entry


def test_hpack_bomb_is_refused_at_the_frame_header(gateway: GatewayThread, triton: LocalTriton) -> None:
    """One 4 KB header referenced 100,000 times (a 100 KB block, a 400 MB header list): refused
    by its size before a byte of it is decoded, spread over CONTINUATION frames or not."""
    with watch(gateway, triton, rss_bound_mb=32):
        for split in (False, True):
            attacker = Attacker(gateway.settings.grpc_port)
            block = bomb(attacker, 100_000)
            if split:
                pieces = [block[i:i + 16384] for i in range(0, len(block), 16384)]
                data = frame(HEADERS, END_STREAM, 1, pieces[0]) + b"".join(
                    frame(CONTINUATION, END_HEADERS if i == len(pieces) - 1 else 0, 1, piece)
                    for i, piece in enumerate(pieces[1:], 1))
            else:
                data = frame(HEADERS, END_STREAM | END_HEADERS, 1, block)
            attacker.send(data)
            assert attacker.goaway().code == ENHANCE_YOUR_CALM
            attacker.close()


def test_a_header_list_past_the_limit_is_never_built(gateway: GatewayThread, triton: LocalTriton) -> None:
    """A 5 KB block that decodes to 4 MB of headers: answered RESOURCE_EXHAUSTED on its stream,
    and the connection (its HPACK table in step) serves the next request."""
    with watch(gateway, triton, rss_bound_mb=32, completed=[1]):
        attacker = Attacker(gateway.settings.grpc_port)
        attacker.send(frame(HEADERS, END_STREAM | END_HEADERS, 1, bomb(attacker, 1000)))
        attacker.send(attacker.headers(3, request_headers()) + frame(0, END_STREAM, 3, infer_message()))
        assert attacker.statuses(1, 3) == {1: RESOURCE_EXHAUSTED, 3: 0}, "and the connection still serves requests"
        attacker.close()


# -- the HTTP port's head: URL, header bytes and count, bounded while parsing (issue 22) --------

def http_answer(port: int, head: bytes, chunk: int = 64 << 10, until_bytes: int = 0) -> tuple[int, dict[str, str],
                                                                                              dict[str, str], int]:
    """Send ``head`` (then filler head bytes up to ``until_bytes``, as one endless header line
    would) until the gateway answers; (status, headers, JSON body, bytes sent before the answer)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sent, received = 0, b""
    try:
        sock.setblocking(False)
        pieces = [head[i:i + chunk] for i in range(0, len(head), chunk)]
        filler = b"a" * chunk
        while b"\r\n\r\n" not in received:
            piece = pieces.pop(0) if pieces else filler if sent < until_bytes else b""
            if piece:
                try:
                    sent += sock.send(piece)
                except BlockingIOError:
                    pass
                except OSError:
                    piece = b""  # closed: read what came
            ready, _, _ = select.select([sock], [], [], 0.01 if piece else 5)
            if ready:
                data = sock.recv(1 << 16)
                if not data:
                    break
                received += data
        sock.setblocking(True)
        head_part, _, body = received.partition(b"\r\n\r\n")
        lines = head_part.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        while len(body) < int(headers["content-length"]):
            body += sock.recv(1 << 16)
        return int(lines[0].split()[1]), headers, json.loads(body), sent
    finally:
        sock.close()


def test_http_head_bounds_answer_414_and_431_in_json(gateway: GatewayThread, triton: LocalTriton) -> None:
    """Each bound of the head, just over it: a clear JSON answer, nothing forwarded. Just under
    them, the request is served."""
    port = gateway.settings.port
    infer = b"POST /v2/models/qc/infer HTTP/1.1\r\nhost: gateway\r\n"
    body = b"content-length: %d\r\n\r\n%s" % (len(INFER_BODY), INFER_BODY)
    with watch(gateway, triton, rss_bound_mb=32, completed=[2]):
        status, headers, answer, _ = http_answer(port, b"GET /v2/" + b"a" * 4000 + b" HTTP/1.1\r\n\r\n")
        assert (status, answer) == (414, {"error": "request URL over 4000 bytes (max_url_bytes)"})
        assert headers["content-type"] == "application/json" and headers["connection"] == "close"
        many = b"".join(b"x-%d: 1\r\n" % i for i in range(100))  # with host: 101
        assert http_answer(port, infer + many + body)[:3:2] == (
            431, {"error": "more than 100 request header lines (max_header_count)"})
        big = b"x-big: " + b"b" * (64 << 10) + b"\r\n"
        assert http_answer(port, infer + big + body)[:3:2] == (
            431, {"error": "request header lines over 65536 bytes together (max_header_bytes)"})
        spread = b"".join(b"x-%d: %s\r\n" % (i, b"s" * 1000) for i in range(66))
        assert http_answer(port, infer + spread + body)[0] == 431
        # just under every bound: served by Triton
        fits = b"".join(b"x-%d: %s\r\n" % (i, b"s" * 600) for i in range(98))  # ~60 KB, 99 lines with host
        assert http_answer(port, infer + fits + body)[0] == 200
        long_url = b"/v2/models/qc/infer?pad=" + b"p" * (4000 - 24)  # max_url_bytes exactly
        assert http_answer(port, b"POST " + long_url + b" HTTP/1.1\r\nhost: gateway\r\n" + body)[0] == 200


def test_endless_url_or_header_line_is_cut_at_the_bound(gateway: GatewayThread, triton: LocalTriton) -> None:
    """The issue's cases: a 20 MB URL and a 60 MB header line. The gateway answers once the bound
    is crossed (it used to read them whole), and holds none of it."""
    port = gateway.settings.port
    with watch(gateway, triton, rss_bound_mb=32):
        status, _, answer, sent = http_answer(port, b"GET /v2/", until_bytes=20 << 20)
        assert (status, answer["error"]) == (414, "request URL over 4000 bytes (max_url_bytes)")
        assert sent < 8 << 20, f"{sent} bytes of URL went in before the answer"
        status, _, answer, sent = http_answer(port, b"GET /v2/health/ready HTTP/1.1\r\nx-endless: ",
                                              until_bytes=60 << 20)
        assert (status, answer["error"]) == (431, "request header lines over 65536 bytes together "
                                                  "(max_header_bytes)")
        assert sent < 8 << 20, f"{sent} bytes of header went in before the answer"


@pytest.fixture
def long_urls(triton: LocalTriton) -> Iterator[GatewayThread]:
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, max_url_bytes=16 << 10,
                                policies={"qc": {"weights": {"2": 100}}})
    with GatewayThread(settings) as running:
        yield running


def test_no_url_triton_cannot_read_whole_is_forwarded(long_urls: GatewayThread, triton: LocalTriton) -> None:
    """Triton 2.51 reads 4,096 bytes at a time and closes unanswered a request whose read ended
    inside the URL (when the byte past the read is a space or a line end); three in a row ejected
    the server. Even with max_url_bytes raised to 16 KiB, a URL past what fits that first read
    (with the /versions/{v} the gateway adds) is answered 414 and never reaches Triton, and the
    server stays in its fleet; the longest URL that fits is served."""
    port = long_urls.settings.port
    body = b"content-length: %d\r\n\r\n%s" % (len(INFER_BODY), INFER_BODY)
    fits = b"/v2/models/qc/infer?pad=" + b"p" * (TRITON_MAX_TARGET - 24)
    with watch(long_urls, triton, rss_bound_mb=32, completed=[1]):
        for length in (TRITON_MAX_TARGET + 1, 4096, 8000, 16000):
            url = (b"/v2/models/qc/infer?pad=" + b";" * length)[:length]
            status, headers, answer, _ = http_answer(port, b"POST " + url + b" HTTP/1.1\r\nhost: gw\r\n" + body)
            assert status == 414 and headers["connection"] == "close", (length, status, answer)
            assert answer["error"] == (f"request URL of {length} bytes: Triton's HTTP server reads at most "
                                       f"{TRITON_MAX_TARGET} reliably"), answer
        assert http_answer(port, b"POST " + fits + b" HTTP/1.1\r\nhost: gw\r\n" + body)[0] == 200
    assert not any(server.ejected or server.failures for fleet in long_urls.app.fleets
                   for server in fleet.servers.values())
