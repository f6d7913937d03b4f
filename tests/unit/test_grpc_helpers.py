"""Small pure pieces of the gRPC path: metadata filtering, timeouts, status encoding, outcomes."""

from __future__ import annotations

import asyncio
from urllib.parse import unquote

import pytest

from gateway.grpc.front import client_metadata, deadline_of
from gateway.grpc.router import GrpcInfer, client_deadline_ran_out
from gateway.grpc.status import StatusCode, classify, status_name
from gateway.grpc.wire import RouteFields, grpc_message, status_block
from gateway.pipeline import route_metadata
from gateway.routing import Reason
from gateway.telemetry.recorder import Outcome


def test_only_the_clients_own_metadata_goes_upstream() -> None:
    headers = [(b":path", b"/x"), (b":authority", b"gw"), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
               (b"user-agent", b"grpc-python"), (b"grpc-timeout", b"5S"), (b"grpc-accept-encoding", b"gzip"),
               (b"x-user-id", b"u1"), (b"trace-bin", b"AAE")]
    assert client_metadata(headers) == ((b"x-user-id", b"u1"), (b"trace-bin", b"AAE"))


@pytest.mark.parametrize(("value", "seconds"), [(b"5S", 5.0), (b"250m", 0.25), (b"100u", 1e-4), (b"2M", 120.0),
                                                (b"1H", 3600.0), (b"999n", 999e-9)])
def test_grpc_timeout_units(value: bytes, seconds: float) -> None:
    async def remaining() -> float:
        deadline = deadline_of([(b"grpc-timeout", value)])
        assert deadline is not None
        return deadline - asyncio.get_running_loop().time()

    assert asyncio.run(remaining()) == pytest.approx(seconds, abs=0.01)


def test_no_timeout_means_no_deadline() -> None:
    async def deadline() -> float | None:
        return deadline_of([(b"x-user-id", b"u1")])

    assert asyncio.run(deadline()) is None


@pytest.mark.parametrize("value", [b"5X", b"S", b"", b"123456789S", b"-5S", b"1e9S", b"9" * 400 + b"H"])
def test_malformed_timeouts_are_refused(value: bytes) -> None:
    """The gRPC spec allows 1-8 digits and a unit; anything else is the client's error, never a crash."""
    async def deadline() -> float | None:
        return deadline_of([(b"grpc-timeout", value)])

    with pytest.raises(ValueError, match="malformed grpc-timeout"):
        asyncio.run(deadline())


def test_grpc_message_is_percent_encoded_utf8() -> None:
    assert grpc_message("plain text: ok") == b"plain text: ok"
    encoded = grpc_message("100% sure, naïve\nnext")
    assert encoded == b"100%25 sure, na%C3%AFve%0Anext"
    assert unquote(encoded.decode()) == "100% sure, naïve\nnext"
    assert status_block(0, "") == b"\x00\x0bgrpc-status\x010"
    assert b"grpc-message" in status_block(14, "down")


def test_outcomes_by_status_code() -> None:
    assert classify(0) is Outcome.SUCCESS and classify(1) is Outcome.CANCELLED
    assert {classify(code) for code in (14, 13, 2, 4)} == {Outcome.UPSTREAM_ERROR}
    assert classify(8) is Outcome.OVERLOAD, "RESOURCE_EXHAUSTED is load, never the version's fault"
    # Triton's full or timed-out queue: the version's capacity, judged apart (issue 34; overload before it)
    assert classify(14, "Exceeds maximum queue size") is Outcome.REJECTED, "Triton's full queue"
    assert classify(14, "[request id: <id_unknown>] Exceeds maximum queue size") is Outcome.REJECTED
    assert classify(14, "Request timeout expired") is Outcome.REJECTED, "Triton's queue timeout"
    assert classify(14, "failed to connect") is Outcome.UPSTREAM_ERROR
    assert {classify(code) for code in (3, 5, 7, 9, 12, 16)} == {Outcome.CLIENT_ERROR}
    assert status_name(14) == "UNAVAILABLE" and status_name(99) == "UNKNOWN"


def test_a_reset_read_a_loaded_loops_lag_before_the_deadline_is_the_clients_deadline() -> None:
    """The gateway's clock for a call starts when it reads the headers, the client's earlier:
    a reset at the client's 200 ms deadline, its headers read 40 ms late, reads 160 ms in (a
    full suite's run once counted one such as cancelled). A cancel half way is still a cancel."""
    cancel = StatusCode.CANCELLED
    assert client_deadline_ran_out(cancel, 0.2, 0.16)
    assert client_deadline_ran_out(cancel, 10.0, 9.8)
    assert not client_deadline_ran_out(cancel, 0.2, 0.1)
    assert not client_deadline_ran_out(cancel, 10.0, 5.0)
    assert not client_deadline_ran_out(cancel, None, 60.0), "no deadline set: a reset is a cancel"
    assert client_deadline_ran_out(StatusCode.DEADLINE_EXCEEDED, 0.2, 0.01), "Triton's word for it"


def test_route_metadata_names_route_and_version_for_every_route() -> None:
    """Issue 11 changed this on purpose: gRPC used to withhold the routing metadata of pinned
    and default routes; both protocols now announce them the way HTTP always did."""
    assert route_metadata("3", Reason.PINNED) == (("x-gateway-model-version", "3"), ("x-gateway-route", "pinned"))
    assert route_metadata("2", Reason.DEFAULT) == (("x-gateway-model-version", "2"), ("x-gateway-route", "default"))
    assert route_metadata(None, Reason.DEFAULT) == (("x-gateway-route", "default"),)
    assert route_metadata("2", Reason.STICKY) == (("x-gateway-model-version", "2"), ("x-gateway-route", "sticky"))


def test_a_full_triton_queue_is_rejected_and_no_fault_while_not_ready_stays_one() -> None:
    infer = GrpcInfer(None, "ModelInfer", b"", RouteFields("m", "1"), (), None)  # type: ignore[arg-type]
    infer.code, infer.status = StatusCode.UNAVAILABLE.value, "UNAVAILABLE"
    infer.details = "Exceeds maximum queue size"
    assert infer.outcome() is Outcome.REJECTED and infer.fault() is None
    infer.details = "Request for unknown model: 'qc' version 3 is not at ready state"
    assert infer.outcome() is Outcome.UPSTREAM_ERROR and infer.fault() == "UNAVAILABLE"
    infer.code, infer.status = StatusCode.RESOURCE_EXHAUSTED.value, "RESOURCE_EXHAUSTED"
    assert infer.outcome() is Outcome.OVERLOAD and infer.fault() is None
