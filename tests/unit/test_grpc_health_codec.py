"""The two grpc.health.v1 messages, encoded by hand in ``gateway.grpc.health``, read and written
the way the official protos (grpcio-health-checking) read and write them."""

from __future__ import annotations

import pytest
from grpc_health.v1 import health_pb2
from hypothesis import given
from hypothesis import strategies as st

from gateway.grpc.health import NOT_SERVING, SERVICE_UNKNOWN, SERVING, requested_service, status_message


@given(st.text(max_size=300))
def test_the_requested_service_is_read_as_protobuf_writes_it(service: str) -> None:
    assert requested_service(health_pb2.HealthCheckRequest(service=service).SerializeToString()) == service


@pytest.mark.parametrize("status", [SERVING, NOT_SERVING, SERVICE_UNKNOWN])
def test_the_answer_is_what_protobuf_reads(status: int) -> None:
    assert health_pb2.HealthCheckResponse.FromString(status_message(status)).status == status


def test_unknown_fields_are_skipped_and_the_last_service_wins() -> None:
    extra = b"\x10\x96\x01" + b"\x1d\x00\x00\x00\x00" + b"\x21" + bytes(8)  # varint, fixed32, fixed64 fields
    assert requested_service(b"\x0a\x01a" + extra + b"\x0a\x02bc") == "bc"


@pytest.mark.parametrize("raw", [b"\x0a\x05ab", b"\x0a", b"\x10", b"\x0b", b"\x0a\x80"])
def test_truncated_or_impossible_bytes_are_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):
        requested_service(raw)
