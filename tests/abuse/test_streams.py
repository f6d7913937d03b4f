"""Stream attacks: too many streams, ignored windows, repeated END_STREAM, rapid reset."""

from __future__ import annotations

import grpc
import h2.config
import h2.connection
import pytest

from gateway.devtools.local_triton import LocalTriton
from gateway.grpc.wire import grpc_frame
from tests.abuse.attack import (
    CANCEL,
    DATA,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    GOAWAY,
    MB,
    REFUSED_STREAM,
    RST_STREAM,
    STREAM_CLOSED,
    Attacker,
    Frame,
    frame,
    grpc_status,
    infer_message,
    request_headers,
    server_side,
    watch,
)
from tests.support import GatewayThread, gateway_settings, tokens_request

pytestmark = pytest.mark.triton


def test_streams_past_max_concurrent_streams_are_refused(gateway: GatewayThread, triton: LocalTriton) -> None:
    """256 ModelInfer streams held open (HEADERS, no message): the 257th and later get REFUSED_STREAM."""
    limit = gateway.settings.grpc_max_concurrent_streams
    with watch(gateway, triton, rss_bound_mb=32):
        attacker = Attacker(gateway.settings.grpc_port)
        attacker.send(b"".join(attacker.headers(1 + 2 * i, request_headers()) for i in range(limit + 10)))
        resets = attacker.resets(until=2)
        refused = sorted(stream for stream, code in resets.items() if code == REFUSED_STREAM)
        assert refused == [1 + 2 * i for i in range(limit, limit + 10)]
        attacker.close()


def test_a_client_that_ignores_the_windows_is_cut_off(gateway: GatewayThread, triton: LocalTriton) -> None:
    """Four streams each announce a 60 MiB message and the client sends without waiting for
    window. One message is admitted (the connection holds at most one maximum-size message);
    the others get no stream credit, so their next bytes break their window: FLOW_CONTROL_ERROR.
    Before, every byte was credited on receipt: 4 x 60 MiB held."""
    with watch(gateway, triton, rss_bound_mb=128):
        attacker = Attacker(gateway.settings.grpc_port)
        streams = [1, 3, 5, 7]
        announce = b"\x00" + (60 * MB).to_bytes(4, "big")
        attacker.send(b"".join(attacker.headers(s, request_headers()) + frame(DATA, 0, s, announce) for s in streams))
        chunk = bytes(16384)
        for i in range(4 * 64):  # 4 MiB: 1 MiB per stream, four times the stream window
            if not attacker.send(frame(DATA, 0, streams[i % 4], chunk)):
                break
        resets = attacker.resets(until=2, stop=None)
        assert sorted(resets.items()) == [(3, FLOW_CONTROL_ERROR), (5, FLOW_CONTROL_ERROR), (7, FLOW_CONTROL_ERROR)]
        attacker.close()


def test_one_request_stream_makes_at_most_one_upstream_call(gateway: GatewayThread, triton: LocalTriton) -> None:
    """A complete request, then END_STREAM again and again (DATA and trailers): STREAM_CLOSED, one call at most."""
    with watch(gateway, triton, rss_bound_mb=32, completed=[1]):
        attacker = Attacker(gateway.settings.grpc_port)
        again = frame(DATA, END_STREAM, 1, infer_message()) + attacker.headers(1, [(b"x-again", b"1")], end_stream=True)
        attacker.send(attacker.headers(1, request_headers()) + frame(DATA, END_STREAM, 1, infer_message()) + again * 20)
        resets = attacker.resets(until=2)
        assert resets.get(1) == STREAM_CLOSED
        attacker.close()


@pytest.mark.parametrize("complete", [False, True])
def test_rapid_reset_ends_in_enhance_your_calm(gateway: GatewayThread, triton: LocalTriton, complete: bool) -> None:
    """CVE-2023-44487 with the h2 library as the client: open, reset, 1,000 times in one burst.
    Streams reset before their message is whole cause no upstream call at all."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    opened = 0
    for _ in range(1000):  # within h2's own 64 KB connection window
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, request_headers())
        if complete:
            client.send_data(stream_id, infer_message(), end_stream=True)
        client.reset_stream(stream_id)
        opened += 1
    completed = [opened if complete else 0]
    with watch(gateway, triton, rss_bound_mb=64, completed=completed):
        attacker = Attacker(gateway.settings.grpc_port, preface=False)
        attacker.send(client.data_to_send())
        assert attacker.goaway(until=5).code == ENHANCE_YOUR_CALM
        attacker.close()


def test_resets_of_answered_streams_are_not_a_reset_flood(gateway: GatewayThread, triton: LocalTriton) -> None:
    """Not an attack: a client cutting generations short after their first token. 250 streams each
    get a first reply (the second is 10 s away), then all 250 are reset in one burst, more than the
    200 resets a second a connection may send: no GOAWAY, and the next call on the connection is
    answered. A rapid reset is a reset before the answer (the test above); these calls were served,
    and what Triton still does for them is bounded by ``grpc_max_streams_per_client``. Before, every
    reset of a live stream counted: GOAWAY ENHANCE_YOUR_CALM at the 201st (and the reset test's
    client, cancelling after a first reply ~560 times a second, was sent one every ~200 streams)."""
    streams = [1 + 2 * i for i in range(250)]
    assert len(streams) < gateway.settings.grpc_max_concurrent_streams
    attacker = Attacker(gateway.settings.grpc_port)
    opened = request_headers(b"/inference.GRPCInferenceService/ModelStreamInfer")
    message = grpc_frame(tokens_request(2, 10_000))
    attacker.send(b"".join(attacker.headers(s, opened) + frame(DATA, 0, s, message) for s in streams))

    def all_answered(frames: list[Frame]) -> bool:
        return {f.stream_id for f in frames if f.kind == DATA} >= set(streams)

    frames = attacker.frames(until=9, done=all_answered)
    assert all_answered(frames), f"{len({f.stream_id for f in frames if f.kind == DATA})} of 250 first replies"
    attacker.send(b"".join(frame(RST_STREAM, 0, s, CANCEL.to_bytes(4, "big")) for s in streams))
    after = streams[-1] + 2
    attacker.send(attacker.headers(after, request_headers()) + frame(DATA, END_STREAM, after, infer_message()))
    frames = attacker.frames(until=10, done=lambda frames: grpc_status(frames, after) is not None)
    assert [f.code for f in frames if f.kind == GOAWAY] == []
    assert grpc_status(frames, after) == 0
    connection = server_side(gateway, attacker)
    assert connection is not None and not connection.streams, "the reset streams were dropped"
    attacker.close()


def test_rapid_reset_of_stream_infer_calls_ends_in_enhance_your_calm(gateway: GatewayThread,
                                                                     triton: LocalTriton) -> None:
    """The rapid reset on ModelStreamInfer, whose resets once answered are not counted (the test
    above): 400 streams, each opened with a whole request and reset in the same burst, before any
    reply could be read, end in GOAWAY ENHANCE_YOUR_CALM. (The gateway reads 500 frames at a time:
    400 streams put more than 200 resets on one side of any second's boundary.)"""
    attacker = Attacker(gateway.settings.grpc_port)
    opened = request_headers(b"/inference.GRPCInferenceService/ModelStreamInfer")
    cancel = CANCEL.to_bytes(4, "big")
    message = grpc_frame(tokens_request(1))
    attacker.send(b"".join(attacker.headers(s, opened) + frame(DATA, 0, s, message) + frame(RST_STREAM, 0, s, cancel)
                           for s in (1 + 2 * i for i in range(400))))
    assert attacker.goaway(until=5).code == ENHANCE_YOUR_CALM
    attacker.close()


def test_large_messages_multiplexed_on_one_connection_all_complete(triton: LocalTriton) -> None:
    """Not an attack: the memory bound must not stall honest clients. Eight 3 MiB requests at
    once on one channel, with a 4 MiB message limit: together far above what the connection may
    hold, so they are taken a few at a time, and every one is answered."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, grpc_max_message_bytes=4 * MB)
    unknown_field = b"\x7a" + _varint(3 * MB) + bytes(3 * MB)  # field 15, skipped by Triton's parser
    with GatewayThread(settings):
        channel = grpc.insecure_channel(f"127.0.0.1:{settings.grpc_port}",
                                        options=[("grpc.max_send_message_length", 8 * MB)])
        call = channel.unary_unary("/inference.GRPCInferenceService/ServerMetadata")
        futures = [call.future(unknown_field, timeout=20) for _ in range(8)]
        answers = [future.result() for future in futures]
        channel.close()
    assert all(b"triton" in answer for answer in answers)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
