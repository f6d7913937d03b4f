"""The controller restores only what the gateway changed (issue 24 item 6), on the real Triton.

Before, the lease holder reloaded every model it had ever loaded or unloaded to the whole
version set it last wrote, so a load or unload made on Triton's own port (the one the data
port's 403 points SREs to) was undone within seconds. Now the store keeps the gateway's own
loads and unloads; a Triton that lost them (a restart falls back to config.pbtxt) gets them
back, and everything else Triton serves is left as it is and shown as ``managed_by: triton``.
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.fleet_support import ready_versions
from tests.support import TOKEN, GatewayThread, admin_call, gateway_settings, wait_for

pytestmark = pytest.mark.triton


def load_on_triton(triton: LocalTriton, versions: list[int]) -> None:
    """A load made on Triton's own HTTP port, with a version_policy (Triton's current config, as
    an operator would send it)."""
    with urllib.request.urlopen(f"{triton.http_url}/v2/models/qc/config", timeout=10) as response:
        config = json.loads(response.read())
    config["version_policy"] = {"specific": {"versions": versions}}
    body: dict[str, Any] = {"parameters": {"config": json.dumps(config)}}
    request = urllib.request.Request(f"{triton.http_url}/v2/repository/models/qc/load", method="POST",
                                     data=json.dumps(body).encode())
    urllib.request.urlopen(request, timeout=120).close()


def managed(url: str) -> dict[str, str]:
    models = admin_call(url, "GET", "/admin/models")[1]["models"]
    return {v["version"]: v["managed_by"] for m in models if m["name"] == "qc" for v in m["versions"]}


def test_loads_on_tritons_own_port_are_left_alone_and_the_gateways_own_are_restored() -> None:
    """Over 30 s: a Triton of its own is stopped and started again, and the gateway must see it gone and back."""
    own = LocalTriton.on_free_ports(models=("qc",)).start()  # restarted below
    try:
        settings = gateway_settings(own.http_url, admin_token=TOKEN, controller_tick_s=0.2)
        with GatewayThread(settings) as gw:
            status, body = admin_call(gw.url, "POST", "/admin/models/qc/versions/1/unload")
            assert status == 200, body
            assert ready_versions(own) == {"2", "3"}

            wait_for(lambda: gw.app.rollouts.fence is not None, 30, what="the controller's lease (it restores)")
            load_on_triton(own, [2])  # an SRE unloads 3 on Triton's own port
            assert ready_versions(own) == {"2"}
            time.sleep(12)  # the restore's 2 s grace and many ticks (the old restore undid it after 7.5 s here)
            assert ready_versions(own) == {"2"}, "the out-of-band unload stands (it was undone before)"
            assert managed(gw.url) == {"1": "gateway", "2": "triton", "3": "triton"}

            own.stop()  # a restart: Triton comes back with config.pbtxt's 1, 2, 3
            own.start()
            wait_for(lambda: ready_versions(own) == {"2", "3"}, 30, interval=0.2,
                     what="the gateway's own unload of version 1 made again, and nothing else")
            events = admin_call(gw.url, "GET", "/admin/events?model=qc")[1]["events"]
            assert any(e["action"] == "versions_restored" for e in events)
    finally:
        own.stop()
