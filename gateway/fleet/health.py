"""Active health and discovery for one fleet: who is in it, who is up, what is READY where.

Each server has its own watch loop (a slow model load on one never delays the checks of the
others): every ``interval_s`` it asks ``/v2/health/ready`` and the repository index (which
versions are READY) over the server's control pool. A server that fails the check leaves
service at once. A server that passes it and is not in service (new, restarted, or ejected
by passive health) first gets the fleet's loaded set applied (``Fleet.on_join``, wired to
model control by the app) and only then takes traffic.

A ``dns`` fleet re-resolves its name every ``dns_refresh_s``: new addresses join as above,
vanished ones leave service and are closed. A failed lookup keeps the servers it had (a DNS
blip must not empty a fleet); IPv4 records only for now.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable

from gateway.errors import GatewayError
from gateway.fleet.balancer import Fleet
from gateway.fleet.config import FleetSpec, ServerSpec
from gateway.fleet.members import Server

log = logging.getLogger("gateway.fleet")
Resolver = Callable[[str], Awaitable[list[str]]]
_GONE = "is unreachable"  # HttpUpstream's words for a refused connect: "upstream <url> is unreachable: ..."


async def resolve_ipv4(name: str) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(name, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


async def probe(server: Server, timeout_s: float, max_age_s: float = 0.0) -> dict[str, frozenset[str]] | None:
    """READY versions per model, or None when the server is not ready (or not reachable). The
    index is the server's shared read (``gateway.fleet.reads``): one at most ``max_age_s`` old
    serves, and an unchanged one is the same mapping as before."""
    try:
        response = await server.control.request(b"GET", b"/v2/health/ready", [], timeout_s=timeout_s)
        await response.read()
        if response.status != 200:
            server.last_error = f"/v2/health/ready answered {response.status}"
            return None
        index = await server.reads.index(server, timeout_s, max_age_s)
    except GatewayError as exc:
        server.last_error = exc.message
        return None
    except ValueError:
        server.last_error = "the repository index did not answer a list"
        return None
    return index.ready


class FleetMonitor:
    def __init__(self, fleet: Fleet, spec: FleetSpec, *, interval_s: float = 1.0, dns_refresh_s: float = 5.0,
                 resolve: Resolver = resolve_ipv4) -> None:
        self.fleet = fleet
        self.spec = spec
        self.interval_s = interval_s
        self.dns_refresh_s = dns_refresh_s
        self.timeout_s = max(1.0, min(2.0, 2 * interval_s))
        self.resolve = resolve
        self._watches: dict[str, asyncio.Task[None]] = {}
        self._dns: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Discover and check every server once (traffic starts on known health), then watch."""
        if self.spec.servers is not None:
            for server_spec in self.spec.servers:
                self.fleet.add(server_spec)
        else:
            await self.rediscover()
        await asyncio.gather(*(self.check(server) for server in list(self.fleet.servers.values())))
        for server in list(self.fleet.servers.values()):
            self._watch(server)
        if self.spec.dns is not None:
            self._dns = asyncio.get_running_loop().create_task(self._dns_loop())

    async def stop(self) -> None:
        tasks = [*self._watches.values(), *([self._dns] if self._dns else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._watches.clear()

    # -- discovery -------------------------------------------------------------------------------
    async def rediscover(self) -> None:
        dns = self.spec.dns
        assert dns is not None
        try:
            addresses = await self.resolve(dns.name)
        except OSError as exc:
            log.warning("fleet %s: cannot resolve %s (%s); keeping its %d servers", self.fleet.name, dns.name, exc,
                        len(self.fleet.servers))
            return
        wanted = {f"{ip}:{dns.http_port}": ServerSpec(http=f"http://{ip}:{dns.http_port}", grpc=f"{ip}:{dns.grpc_port}")
                  for ip in addresses}
        for name in [name for name in self.fleet.servers if name not in wanted]:
            log.info("fleet %s: server %s left (no longer in %s)", self.fleet.name, name, dns.name)
            self.fleet.remove(name)
            task = self._watches.pop(name, None)
            if task is not None:
                task.cancel()
        for name, server_spec in wanted.items():
            if name not in self.fleet.servers:
                log.info("fleet %s: server %s joined (found in %s)", self.fleet.name, name, dns.name)
                server = self.fleet.add(server_spec)
                if self._dns is not None:  # after start(): watch it now (start() watches the first ones)
                    self._watch(server)
        await self._close_retired()

    async def _close_retired(self) -> None:
        for server in [s for s in self.fleet.retired if s.inflight == 0]:
            self.fleet.retired.remove(server)
            await server.aclose()

    async def _dns_loop(self) -> None:
        while True:
            await asyncio.sleep(self.dns_refresh_s)
            await self.rediscover()

    # -- health ------------------------------------------------------------------------------------
    def _watch(self, server: Server) -> None:
        if server.name not in self._watches:
            self._watches[server.name] = asyncio.get_running_loop().create_task(self._watch_loop(server))

    async def _watch_loop(self, server: Server) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check(server)
            except Exception:  # never let one bad answer end the watch
                log.exception("fleet %s: health check of %s failed", self.fleet.name, server.name)

    async def check(self, server: Server) -> None:
        fleet = self.fleet
        ready = await probe(server, self.timeout_s, self.interval_s / 2)  # a read shared within half a period
        if ready is None:
            server.probe_failures += 1
            # A refused connect says the server is gone; a slow answer (busy loading a model, a
            # loaded machine) must repeat before it takes a server out.
            if server.probe_failures < 2 and server.in_service and _GONE not in server.last_error:
                return
            if server.up or server.in_service:
                log.warning("fleet %s: server %s is out of service: %s", fleet.name, server.name, server.last_error)
                server.up = server.in_service = False
                fleet.changed()
            return
        server.probe_failures = 0
        server.up = True
        if server.ejected:  # passive ejection ends with a passed check (and the join below)
            server.ejected = False
            server.failures = 0
        if server.in_service:
            if ready is not server.ready and ready != server.ready:
                server.ready = ready
                fleet.changed()
            return
        server.ready = ready
        if fleet.on_join is not None:
            try:
                await fleet.on_join(fleet, server)
            except Exception as exc:  # stays out of service; the next check tries again
                server.last_error = f"joining the fleet failed: {exc}"
                log.warning("fleet %s: server %s cannot join yet: %s", fleet.name, server.name, exc)
                return
            ready = await probe(server, self.timeout_s)
            if ready is None:
                return
            server.ready = ready
        server.in_service = True
        server.last_error = ""
        log.info("fleet %s: server %s is in service", fleet.name, server.name)
        fleet.changed()
