"""On a fleet of two real Triton servers, every access log line names the server that answered it:
the fleet notes the server it chose on the request's exchange, and the log reads it there."""

from __future__ import annotations

import asyncio
import io
import json
from collections import Counter

import pytest

from gateway.devtools.local_triton import LocalTriton
from gateway.grpc.status import StatusCode
from tests.fleet_support import drive_grpc, fleet_settings, successes
from tests.support import GatewayThread, drive, wait_for

pytestmark = pytest.mark.triton
REQUESTS = 40


def test_the_access_log_names_the_server_that_answered(triton_pair: tuple[LocalTriton, LocalTriton]) -> None:
    """Per server, the lines naming it are exactly the inferences that Triton server ran (its own
    statistics), over HTTP and over gRPC."""
    names = [server.http_url.removeprefix("http://") for server in triton_pair]
    settings = fleet_settings(*triton_pair, access_log=True, policies={"qc": {"weights": {"2": 100}}})
    with GatewayThread(settings) as gw:
        assert gw.app.access_log is not None
        stream = io.StringIO()
        gw.app.access_log.stream = stream
        for protocol in ("http", "grpc"):
            before = [successes(server) for server in triton_pair]
            if protocol == "http":
                result = asyncio.run(drive(gw.url, REQUESTS, concurrency=4))
                assert result.statuses == Counter({200: REQUESTS}), result.failures[:3]
            else:
                codes = asyncio.run(drive_grpc(f"127.0.0.1:{settings.grpc_port}", REQUESTS, concurrency=4))
                assert codes == Counter({StatusCode.OK: REQUESTS}), codes

            def counted(before: list[int] = before) -> list[int] | None:  # Triton counts just after answering
                ran = [successes(server) - count for server, count in zip(triton_pair, before, strict=True)]
                return ran if sum(ran) >= REQUESTS else None

            ran = wait_for(counted, 10, interval=0.05, what=f"Triton to count the {protocol} answers")

            def logged(protocol: str = protocol) -> list[dict[str, object]] | None:  # written every flush_s
                lines = [json.loads(line) for line in stream.getvalue().splitlines()]
                mine = [line for line in lines if line["protocol"] == protocol]
                return mine if len(mine) >= REQUESTS else None

            lines = wait_for(logged, 10, interval=0.05, what=f"the {protocol} access log lines")
            by_server = Counter(line["server"] for line in lines)
            assert by_server == Counter(dict(zip(names, ran, strict=True))), (protocol, by_server, ran)
            assert all(count > 0 for count in ran), ("both servers answer a share", ran)
