"""DNS discovery's membership logic with a scripted resolver (no DNS server on a test machine)."""

from __future__ import annotations

from gateway.fleet.balancer import Fleet
from gateway.fleet.config import DnsSpec, FleetSpec
from gateway.fleet.health import FleetMonitor
from gateway.grpc.upstream import GrpcUpstream


async def test_servers_come_and_go_with_the_records_and_a_failed_lookup_keeps_them() -> None:
    answers: list[list[str] | OSError] = [["10.0.0.1", "10.0.0.2"], ["10.0.0.2", "10.0.0.3"],
                                          OSError("temporary failure in name resolution"), []]

    async def resolve(name: str) -> list[str]:
        assert name == "triton-pods.ns.svc"
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    fleet = Fleet("green", grpc_connect=GrpcUpstream)
    monitor = FleetMonitor(fleet, FleetSpec(dns=DnsSpec(name="triton-pods.ns.svc", http_port=8000, grpc_port=9001)),
                           resolve=resolve)
    await monitor.rediscover()
    assert sorted(fleet.servers) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert fleet.servers["10.0.0.1:8000"].spec.grpc == "10.0.0.1:9001"
    await monitor.rediscover()
    assert sorted(fleet.servers) == ["10.0.0.2:8000", "10.0.0.3:8000"]
    assert [s.name for s in fleet.retired] == []  # the one that left had no request in flight: closed at once
    await monitor.rediscover()
    assert sorted(fleet.servers) == ["10.0.0.2:8000", "10.0.0.3:8000"], "a DNS blip empties nothing"
    await monitor.rediscover()
    assert fleet.servers == {}, "no records: no servers (a Service with no Ready pod)"
    await fleet.aclose()
