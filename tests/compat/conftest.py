"""One gateway per module in front of the session's Triton; both are asked the same things."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.support import TOKEN, GatewayThread, gateway_settings


@pytest.fixture(scope="module")
def gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    """No policies: every call goes to Triton as the client sent it, which is what is compared
    (a routed call adds only the routing headers, see ``differences``)."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, admin_token=TOKEN)
    with GatewayThread(settings) as running:
        yield running


@pytest.fixture(scope="module")
def admin_gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    """``triton_control: admin``: Triton's control calls pass with the admin token."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, admin_token=TOKEN,
                                triton_control="admin")
    with GatewayThread(settings) as running:
        yield running


@pytest.fixture(scope="module")
def allow_gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    """``triton_control: allow``: Triton's control calls pass as they are."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, admin_token=TOKEN,
                                triton_control="allow")
    with GatewayThread(settings) as running:
        yield running
