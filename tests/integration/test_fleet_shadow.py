"""A shadow on a named fleet (``"shadow": {"version": "green:2"}``) is sent to that fleet, on both
protocols, against two real Triton servers: the default fleet is one, fleet green the other.

Before, the shadow queue held only the default fleet's upstream (HTTP), and a gRPC copy took the
primary's: every copy ran version 2 on the default fleet's server, and fleet green never saw one.
Its statistics are kept under the name the policy gives it (``green:2``), which the rollout's
shadow gate reads for a canary ``green:2``.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.fleet_support import INFER, fleet_settings, infer_message, successes
from tests.support import GatewayThread, wait_for

pytestmark = pytest.mark.triton
CALLS = 10  # per protocol


def http_infer(url: str) -> None:
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]})
    request = urllib.request.Request(f"{url}/v2/models/qc/infer", data=body.encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200


def test_a_shadow_on_a_named_fleet_runs_there_on_both_protocols(triton_pair: tuple[LocalTriton, LocalTriton]) -> None:
    import grpc

    default, green = triton_pair
    settings = fleet_settings(default, fleets={"green": {"servers": [{"http": green.http_url,
                                                                      "grpc": green.grpc_url}]}},
                              policies={"qc": {"weights": {"2": 100},
                                               "shadow": {"version": "green:2", "percent": 100}}})
    with GatewayThread(settings) as gw:
        before = successes(default, version="2"), successes(green, version="2")
        for _ in range(CALLS):
            http_infer(gw.url)
        channel = grpc.insecure_channel(f"127.0.0.1:{settings.grpc_port}")
        try:
            infer = channel.unary_unary(INFER)
            for _ in range(CALLS):
                infer(infer_message("qc"), timeout=30)
        finally:
            channel.close()
        wait_for(lambda: successes(green, version="2") - before[1] >= 2 * CALLS, 30,
                 what=f"fleet green to run the {2 * CALLS} copies")
        stats = gw.app.recorder.shadow_stats("qc", "green:2")
        wait_for(lambda: stats.requests >= 2 * CALLS, 10, what="every copy to be counted under green:2")
        assert stats.errors == 0 and stats.compared == stats.agreed == 2 * CALLS, vars(stats)
        assert successes(green, version="2") - before[1] == 2 * CALLS
        assert successes(default, version="2") - before[0] == 2 * CALLS, "the default fleet ran the primaries only"
