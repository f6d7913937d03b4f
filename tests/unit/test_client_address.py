"""An IPv6 client is its /64, to every per-client bound: one host picks its source address from
2^64 of them, and as that many clients it would pass the connection cap, the sequence-pin quota
and the judge's per-client down-weighting as if they were not there."""

from __future__ import annotations

import pytest

from gateway.client_address import ClientAddresses, PerAddress, client_key
from gateway.grpc.grpcio_front import CallingConnections


@pytest.mark.parametrize(("address", "key"), [
    ("10.0.0.5", "10.0.0.5"),
    ("2001:db8:1:2::1", "2001:db8:1:2::/64"),
    ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),
    ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
    ("::ffff:10.0.0.5", "10.0.0.5"),  # an IPv4 client on a dual-stack socket
    ("fe80::1%eth0", "fe80::/64"),
    ("", ""),
    ("not:an:address", "not:an:address"),
])
def test_client_key(address: str, key: str) -> None:
    assert client_key(address) == key


def test_the_connection_cap_counts_an_ipv6_64_as_one_client() -> None:
    table = PerAddress()
    assert table.admit("2001:db8::1", 2) and table.admit("2001:db8::2", 2)
    assert not table.admit("2001:db8::ffff", 2), "a third address of the same /64"
    assert table.admit("2001:db8:0:1::1", 2), "the next /64 is another client"
    table.leave("2001:db8::2")
    assert table.admit("2001:db8::3", 2)
    for address in ("2001:db8::1", "2001:db8::3", "2001:db8:0:1::1"):
        table.leave(address)
    assert table == {}


def test_grpcio_connections_are_capped_per_64_too() -> None:
    calls = CallingConnections(1)
    assert calls.enter("ipv6:[2001:db8::1]:5000") == ""
    assert "max_connections_per_client" in calls.enter("ipv6:[2001:db8::2]:5001")
    calls.leave("ipv6:[2001:db8::1]:5000")
    assert calls.calls == {}


def test_the_client_of_a_request_is_the_64_of_its_peer_or_of_the_forwarded_address() -> None:
    assert ClientAddresses().of("2001:db8::7") == "2001:db8::/64"
    behind = ClientAddresses(["10.0.0.0/8"])
    assert behind.of("10.0.0.1", [(b"x-forwarded-for", b"2001:db8:5::9")]) == "2001:db8:5::/64"
    assert behind.of("2001:db8::7", [(b"x-forwarded-for", b"192.0.2.1")]) == "2001:db8::/64", "untrusted peer"
