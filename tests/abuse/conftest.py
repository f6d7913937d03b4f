from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.abuse.attack import Attacker
from tests.support import GatewayThread, gateway_settings


@pytest.fixture(autouse=True)
def close_attackers() -> Iterator[None]:
    yield
    for attacker in list(Attacker.live):
        attacker.close()


@pytest.fixture(scope="package")
def gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    """The gateway with its default limits (the acceptance says: attacks against the defaults)."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url,
                                policies={"qc": {"weights": {"2": 100}}})
    assert settings.grpc_server == "lean"
    with GatewayThread(settings) as running:
        yield running


@pytest.fixture(scope="package")
def impatient_gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    """The same with 1-second timeouts, so the timeout tests take seconds, not minutes."""
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url,
                                policies={"qc": {"weights": {"2": 100}}}, grpc_preface_timeout_s=1.0,
                                grpc_header_timeout_s=1.0, grpc_idle_timeout_s=1.0)
    with GatewayThread(settings) as running:
        yield running

