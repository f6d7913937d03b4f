"""Every fleet of the gateway, built from settings, started and stopped together."""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable, Iterator

from gateway.fleet.balancer import Fleet
from gateway.fleet.config import DEFAULT_FLEET, FleetSpec
from gateway.fleet.health import FleetMonitor, Resolver, resolve_ipv4
from gateway.fleet.members import GrpcConnect, Server


class Fleets:
    def __init__(self, specs: dict[str, FleetSpec], *, grpc_connect: GrpcConnect, pool_size: int = 128,
                 connect_timeout_s: float = 2.0, request_timeout_s: float = 60.0, max_inflight: int = 0,
                 queue_timeout_s: float | None = None, eject_after: int = 3, health_interval_s: float = 1.0,
                 dns_refresh_s: float = 5.0, resolve: Resolver = resolve_ipv4,
                 http_tls: ssl.SSLContext | None = None, max_sequence_pins: int = 100_000,
                 max_sequence_pins_per_client: int = 1_000) -> None:
        assert DEFAULT_FLEET in specs, "the default fleet is always configured (Settings.fleet_specs)"
        self.specs = specs
        self.fleets = {name: Fleet(name, grpc_connect=grpc_connect, pool_size=pool_size,
                                   connect_timeout_s=connect_timeout_s, request_timeout_s=request_timeout_s,
                                   max_inflight=max_inflight, queue_timeout_s=queue_timeout_s,
                                   eject_after=eject_after, http_tls=http_tls, max_sequence_pins=max_sequence_pins,
                                   max_sequence_pins_per_client=max_sequence_pins_per_client)
                       for name in specs}
        self.monitors = {name: FleetMonitor(self.fleets[name], spec, interval_s=health_interval_s,
                                            dns_refresh_s=dns_refresh_s, resolve=resolve)
                         for name, spec in specs.items()}
        self.started = False

    @property
    def default(self) -> Fleet:
        return self.fleets[DEFAULT_FLEET]

    def __getitem__(self, name: str) -> Fleet:
        return self.fleets[name]

    def __contains__(self, name: object) -> bool:
        return name in self.fleets

    def __iter__(self) -> Iterator[Fleet]:
        return iter(self.fleets.values())

    def on_join(self, hook: Callable[[Fleet, Server], Awaitable[None]]) -> None:
        for fleet in self.fleets.values():
            fleet.on_join = hook

    async def start(self) -> None:
        for monitor in self.monitors.values():
            await monitor.start()
        self.started = True

    async def stop(self) -> None:
        for monitor in self.monitors.values():
            await monitor.stop()
        for fleet in self.fleets.values():
            await fleet.aclose()
        self.started = False

    def describe(self) -> dict[str, list[dict[str, object]]]:
        return {name: fleet.describe() for name, fleet in self.fleets.items()}
