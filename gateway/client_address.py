"""Who a request's client is, for the rollout judge's per-client shares (issue 23, item 2),
the sequence-pin quota and the connection cap per client (an IPv6 client is its /64).

The client is the peer address of the connection, or, when that peer is one of the
``trusted_proxies`` (CIDRs; none by default), the address that proxy put in
``X-Forwarded-For``: walking the header from the right, the first address that is not itself a
trusted proxy (behind a load balancer every request would otherwise be one client; an address
an untrusted peer writes into the header is never believed). A header that cannot be read
leaves the trusted peer as the client. No parsing at all without trusted proxies: the peer's
address string as the server gave it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
MAX_CACHED = 4096  # peer addresses whose trust (or key) was decided, kept; past it, decided again each time
# An IPv6 client is its /64: one subscriber's allocation (RFC 6177; ISPs hand out a /64 or
# more), so one host can take any of 2^64 source addresses and would otherwise be that many
# clients to every per-client cap, quota and share.
IPV6_CLIENT_PREFIX = 64
_ipv6_keys: dict[str, str] = {}


def client_key(address: str) -> str:
    """Who holds ``address``: an IPv4 address itself (no parsing), an IPv6 address its /64, an
    IPv4-mapped IPv6 address its IPv4 address; anything else as it is."""
    if ":" not in address:
        return address
    key = _ipv6_keys.get(address)
    if key is None:
        try:
            parsed = ipaddress.IPv6Address(address.partition("%")[0])  # a link-local scope is not part of it
        except ValueError:
            return address
        mapped = parsed.ipv4_mapped
        key = str(mapped) if mapped is not None else str(
            ipaddress.IPv6Network((parsed, IPV6_CLIENT_PREFIX), strict=False))
        if len(_ipv6_keys) < MAX_CACHED:
            _ipv6_keys[address] = key
    return key


class ClientAddresses:
    def __init__(self, trusted_proxies: Sequence[str] = ()) -> None:
        self.trusted: tuple[Network, ...] = ()
        self._verdicts: dict[str, bool] = {}
        self.replace(trusted_proxies)

    def replace(self, trusted_proxies: Sequence[str]) -> None:
        """Trust these proxies from now on (SIGHUP)."""
        self.trusted = tuple(ipaddress.ip_network(cidr, strict=False) for cidr in trusted_proxies)
        self._verdicts = {}

    def of(self, peer: str | None, headers: Iterable[tuple[bytes, bytes]] = ()) -> str:
        """The client of a request from ``peer`` with these (lower-case) headers."""
        peer = peer or ""
        if not self.trusted or not self.is_trusted(peer):
            return client_key(peer)
        forwarded = b",".join(value for name, value in headers if name == b"x-forwarded-for")
        if not forwarded:
            return client_key(peer)
        for hop in reversed(forwarded.split(b",")):
            address = hop.strip().decode("latin-1")
            if not _valid(address):
                return client_key(peer)
            if not self.is_trusted(address):
                return client_key(address)
        return client_key(peer)

    def of_control(self, peer: str | None, headers: Iterable[tuple[bytes, bytes]]) -> str:
        """The client of a request to the control app (``/admin``, ``/console``, ``/metrics``). Without
        a peer it came over the control plane's Unix socket (``--workers``): the last
        ``X-Forwarded-For`` line is the TCP peer the worker's forwarder saw and appended, the lines
        before it what that peer sent (believed only from a trusted proxy, as always)."""
        if peer:
            return self.of(peer, headers)
        lines = [value for name, value in headers if name == b"x-forwarded-for"]
        if not lines:
            return "unknown"
        seen = lines[-1].rpartition(b",")[2].strip().decode("latin-1")
        return self.of(seen, [(b"x-forwarded-for", line) for line in lines[:-1]])

    def is_trusted(self, address: str) -> bool:
        verdict = self._verdicts.get(address)
        if verdict is None:
            try:
                parsed = ipaddress.ip_address(address)
            except ValueError:
                verdict = False
            else:
                verdict = any(parsed in network for network in self.trusted)
            if len(self._verdicts) < MAX_CACHED:
                self._verdicts[address] = verdict
        return verdict


def _valid(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


class PerAddress(dict[str, int]):
    """Open connections per client address, for ``max_connections_per_client``: one table per
    port, shared by its connections (one event loop: no lock). The HTTP port's protocol and the
    gRPC port's HTTP/2 connections both count here, the same way; a dict, so readers read a dict."""

    __slots__ = ()

    def admit(self, address: str, limit: int) -> bool:
        """Count one more connection from ``address`` (its :func:`client_key`); False, counting
        nothing, when it has ``limit`` open."""
        address = client_key(address)
        held = self.get(address, 0)
        if held >= limit:
            return False
        self[address] = held + 1
        return True

    def leave(self, address: str) -> None:
        """A connection :meth:`admit` counted closed."""
        address = client_key(address)
        left = self[address] - 1
        if left:
            self[address] = left
        else:
            del self[address]


def grpcio_peer(peer: str | None) -> str:
    """The address in grpcio's ``context.peer()``: "ipv4:127.0.0.5:5555", "ipv6:[::1]:5555"."""
    if not peer:
        return ""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest[1:rest.index("]")] if rest.startswith("[") and "]" in rest else rest
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    return peer
