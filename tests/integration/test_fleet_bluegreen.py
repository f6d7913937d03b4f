"""Blue/green between two fleets of real Triton servers: policy targets 'fleet:version', and a
rollout from fleet blue to fleet green that is rolled back when green is unhealthy."""

from __future__ import annotations

import time

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.conftest import Faults
from tests.fleet_support import fleet_settings, successes
from tests.support import BackgroundLoad, GatewayThread, admin_call, wait_for

pytestmark = pytest.mark.triton


def two_fleets(pair: tuple[LocalTriton, LocalTriton]) -> dict[str, object]:
    blue, green = pair
    return {"blue": {"servers": [{"http": blue.http_url, "grpc": blue.grpc_url}]},
            "green": {"servers": [{"http": green.http_url, "grpc": green.grpc_url}]}}


def test_a_rollout_from_fleet_blue_to_an_unhealthy_fleet_green_is_rolled_back(
        triton_pair: tuple[LocalTriton, LocalTriton], faults: Faults) -> None:
    blue, green = triton_pair
    settings = fleet_settings(*triton_pair, fleets=two_fleets(triton_pair), controller_tick_s=0.2,
                              policies={"qc": {"weights": {"blue:2": 100}}})
    with GatewayThread(settings) as gw:
        # a target on a fleet is checked on that fleet: version 9 exists nowhere, fleet red is not configured
        status, body = admin_call(gw.url, "PUT", "/admin/models/qc/policy", {"weights": {"blue:2": 90, "green:9": 10}})
        assert status == 409 and "fleet 'green'" in body["error"], body
        status, body = admin_call(gw.url, "PUT", "/admin/models/qc/policy", {"weights": {"blue:2": 90, "red:2": 10}})
        assert status == 409 and "fleet 'red'" in body["error"], body

        before = successes(blue, version="2"), successes(green, version="3"), successes(blue, version="3")
        faults.set("qc", "3", error_rate=0.3)  # green's candidate version fails (blue never routes to 3)
        with BackgroundLoad(gw.url) as load:
            time.sleep(0.5)
            status, doc = admin_call(gw.url, "POST", "/admin/models/qc/rollout", {
                "canary": "green:3", "stable": "blue:2", "steps": [10, 50, 100], "interval_s": 2,
                "min_requests": 20, "failure_limit": 2})
            assert status == 200, doc

            def finished() -> dict[str, object] | None:
                doc = admin_call(gw.url, "GET", "/admin/models/qc/rollout")[1]
                return doc if doc["state"] != "progressing" else None

            doc = wait_for(finished, 25, what="the rollout to end")
        assert doc["state"] == "rolled_back", doc
        assert doc["weights"] == {"blue:2": 100, "green:3": 0}, doc
        assert admin_call(gw.url, "GET", "/admin/models/qc/policy")[1]["weights"] == {"blue:2": 100, "green:3": 0}
        assert load.result.versions["2"] > 0 and load.result.versions["3"] > 0, load.result.versions
        assert "injected fault in version 3" in " ".join(load.result.failures)
        # Triton counts a request its model answered with an error as executed: >= the clean answers
        assert successes(blue, version="2") - before[0] >= load.result.versions["2"] > 0
        assert successes(green, version="3") - before[1] >= load.result.versions["3"] > 0
        assert successes(blue, version="3") == before[2], "the canary ran on fleet green only"


def test_a_target_on_fleet_default_is_the_default_fleet_on_both_ports(
        triton_pair: tuple[LocalTriton, LocalTriton]) -> None:
    """``default:3`` names the fleet ``default`` of the config: the admin API and the config file
    took it, while both ports looked it up among the named fleets and answered "fleet 'default' is
    not configured". It is stored as ``3``, the one spelling the data plane reads."""
    import asyncio
    import json
    import urllib.request

    from tritonclient.grpc import service_pb2

    from gateway.grpc.status import StatusCode
    from gateway.grpc.upstream import GrpcUpstream
    from tests.fleet_support import INFER, infer_message
    from tests.support import INFER_BODY

    main, green = triton_pair
    fleets = {"default": {"servers": [{"http": main.http_url, "grpc": main.grpc_url}]},
              "green": {"servers": [{"http": green.http_url, "grpc": green.grpc_url}]}}
    settings = fleet_settings(*triton_pair, fleets=fleets, policies={"qc": {"weights": {"default:2": 100}}})

    def http_version(url: str) -> str:
        request = urllib.request.Request(f"{url}/v2/models/qc/infer", data=INFER_BODY)
        with urllib.request.urlopen(request, timeout=10) as response:
            return str(json.loads(response.read())["model_version"])

    async def grpc_version(address: str) -> str:
        client = GrpcUpstream(address)
        try:
            code, details, answer = await client.unary(INFER, infer_message(), (), 10.0)
        finally:
            await client.aclose()
        assert code == StatusCode.OK, details
        reply = service_pb2.ModelInferResponse()
        reply.ParseFromString(answer)
        return str(reply.model_version)

    with GatewayThread(settings) as gw:
        grpc_address = f"127.0.0.1:{gw.settings.grpc_port}"
        # from the config file
        assert admin_call(gw.url, "GET", "/admin/models/qc/policy")[1]["weights"] == {"2": 100}
        assert http_version(gw.url) == "2" and asyncio.run(grpc_version(grpc_address)) == "2"

        # from the admin API, with a named fleet beside it
        status, body = admin_call(gw.url, "PUT", "/admin/models/qc/policy",
                                  {"weights": {"default:3": 100, "green:2": 0}})
        assert status == 200 and body["weights"] == {"3": 100, "green:2": 0}, body
        before = successes(main, version="3"), successes(green, version="3")
        assert http_version(gw.url) == "3" and asyncio.run(grpc_version(grpc_address)) == "3"
        assert successes(main, version="3") - before[0] == 2, "both went to the default fleet"
        assert successes(green, version="3") == before[1]

        status, body = admin_call(gw.url, "PATCH", "/admin/models/qc/policy/weights", {"weights": {"default:2": 100}})
        assert status == 200 and body["weights"] == {"2": 100}, body
        assert http_version(gw.url) == "2"

        # one target spelt twice is refused, and changes nothing
        revision = admin_call(gw.url, "GET", "/admin/models/qc/policy")[1]["revision"]
        for method, path in (("PUT", "/admin/models/qc/policy"), ("PATCH", "/admin/models/qc/policy/weights")):
            status, body = admin_call(gw.url, method, path, {"weights": {"default:3": 50, "3": 50}})
            assert status == 422 and "'default:3' and '3'" in body["error"], body
        after = admin_call(gw.url, "GET", "/admin/models/qc/policy")[1]
        assert after["revision"] == revision and after["weights"] == {"2": 100}, after
