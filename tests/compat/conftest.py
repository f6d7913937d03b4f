"""One gateway per module in front of the session's Triton (and one per ``triton_control``
mode for the control calls); each is asked the same things as Triton."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.support import TOKEN, GatewayThread, gateway_settings


def _running(triton: LocalTriton, control: str) -> Iterator[GatewayThread]:
    """No policies: every call goes to Triton as the client sent it, which is what is compared
    (a routed call adds only the routing headers, see ``differences``)."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, admin_token=TOKEN,
                                triton_control=control)
    with GatewayThread(settings) as running:
        yield running


@pytest.fixture(scope="module")
def gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    """The default, ``triton_control: deny``: Triton's control calls are refused."""
    yield from _running(triton, "deny")


@pytest.fixture(scope="module")
def admin_gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    """``triton_control: admin``: Triton's control calls pass with the admin token."""
    yield from _running(triton, "admin")


@pytest.fixture(scope="module")
def allow_gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    """``triton_control: allow``: Triton's control calls pass as they are."""
    yield from _running(triton, "allow")
