"""Issue 33 (friction 8): no silent side effects. Each command whose effect reaches beyond what
it names says so in its answer (``warnings``, printed by ``gateway ctl``), and a finished
rollback stays in the console's "Needs attention" until someone acknowledges it (audited).
Against a real gateway and Triton; the rollouts' intervals are long, nothing here is judged
except the rollback, which a failing canary brings within a few 1 s intervals."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.conftest import Faults
from tests.support import (
    TOKEN,
    BackgroundLoad,
    GatewayThread,
    admin_call,
    gateway_settings,
    rollout_gateway,
    rollout_status,
    wait_for,
)

pytestmark = pytest.mark.triton


@pytest.fixture
def gateway(triton: LocalTriton) -> Iterator[GatewayThread]:
    with rollout_gateway(triton.http_url) as running:
        yield running


def call(gateway: GatewayThread, method: str, path: str, body: Any = None) -> dict[str, Any]:
    status, doc = admin_call(gateway.url, method, path, body)
    assert status == 200, doc
    assert isinstance(doc, dict)
    return doc


def test_weights_during_a_rollout_say_they_pause_it_and_promote_says_it_resumes_over_them(
        gateway: GatewayThread) -> None:
    call(gateway, "POST", "/admin/models/qc/rollout", {"canary": "3", "steps": [5, 20, 100], "interval_s": 600})
    answer = call(gateway, "PATCH", "/admin/models/qc/policy/weights", {"weights": {"2": 70, "3": 30}})
    assert any("rollout of qc (progressing, step 1 of 3) pauses" in w for w in answer["warnings"]), answer
    wait_for(lambda: rollout_status(gateway.url)["state"] == "paused", 10, what="the rollout paused")
    # the CLI prints what the answer says (and the weights the person set stay until a resume)
    done = subprocess.run([sys.executable, "-m", "gateway", "ctl", "--url", gateway.url, "--token", TOKEN,
                           "weights", "set", "qc", "2=60", "3=40"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "note: the rollout of qc is paused: a resume or promote puts its own weights back" in done.stderr
    answer = call(gateway, "POST", "/admin/models/qc/rollout/promote")
    assert answer["warnings"] == ["promote resumes the paused rollout a step further, over the weights set while it "
                                  "was paused: 2: 60%, 3: 40% become 2: 80%, 3: 20%"], answer
    assert answer["state"] == "progressing" and answer["weights"] == {"2": 80, "3": 20}


def test_a_rollout_start_says_it_cuts_a_30_percent_canary_to_its_first_step(gateway: GatewayThread) -> None:
    call(gateway, "PATCH", "/admin/models/qc/policy/weights", {"weights": {"1": 10, "2": 60, "3": 30}})
    answer = call(gateway, "POST", "/admin/models/qc/rollout", {"canary": "3", "steps": [5, 100], "interval_s": 600})
    assert answer["warnings"] == [
        "canary 3 takes 30% now: the rollout starts it at 5% (step 1), so 25% of qc's traffic moves back to 2",
        "1: 10% of qc's traffic goes to the rollout's versions (weights now 1: 10%, 2: 60%, 3: 30%, then "
        "2: 95%, 3: 5%)"], answer
    call(gateway, "POST", "/admin/models/qc/rollout/abort")


def test_a_put_that_leaves_out_a_header_rule_says_it_drops_it(gateway: GatewayThread) -> None:
    rule = {"header": "x-canary", "equals": "always", "version": "3"}
    first = call(gateway, "PUT", "/admin/models/qc/policy", {"weights": {"2": 100}, "rules": [rule]})
    assert first["warnings"] == []
    answer = call(gateway, "PUT", "/admin/models/qc/policy", {"weights": {"2": 90, "3": 10}})
    assert answer["warnings"] == ["the header rule x-canary: always -> version 3 is dropped (this policy does not "
                                  "have it)"], answer
    events = call(gateway, "GET", "/admin/events?model=qc&limit=1")["events"]
    assert "rules[0]: removed" in events[0]["changes"][-1]["words"], events[0]["changes"]


def console_overview(gateway: GatewayThread, http: httpx.Client) -> dict[str, Any]:
    answer = http.get("/console/api/overview")
    assert answer.status_code == 200, answer.text
    doc: dict[str, Any] = answer.json()
    return doc


def test_a_finished_rollback_needs_attention_until_acknowledged(gateway: GatewayThread, faults: Faults) -> None:
    faults.set("qc", "3", error_rate=1.0)
    with BackgroundLoad(gateway.url):
        call(gateway, "POST", "/admin/models/qc/rollout", {"canary": "3", "steps": [20, 100], "interval_s": 1,
                                                           "judge": "thresholds", "min_requests": 5,
                                                           "failure_limit": 1})
        wait_for(lambda: rollout_status(gateway.url)["state"] == "rolled_back", 30, what="the rollback")
    faults.clear()
    origin = {"Origin": gateway.url}
    with httpx.Client(base_url=gateway.url, timeout=10) as http:
        login = http.post("/console/login", json={"token": TOKEN}, headers=origin)
        assert login.status_code == 200, login.text
        csrf = login.json()["csrf"]
        attention = console_overview(gateway, http)["attention"]
        flagged = [a for a in attention if a.get("model") == "qc"]
        assert flagged and flagged[0]["acknowledge"] and "rollout of qc was rolled back" in flagged[0]["text"]
        # a second look changes nothing: it stays until someone says they saw it
        assert [a for a in console_overview(gateway, http)["attention"] if a.get("model") == "qc"] == flagged
        status, doc = admin_call(gateway.url, "POST", "/admin/models/qc/rollout/abort")
        assert status == 409, doc  # not an acknowledgement
        done = http.post("/console/api/models/qc/rollout/acknowledge", json={},
                         headers={**origin, "X-CSRF-Token": csrf})
        assert done.status_code == 200, done.text
        assert done.json()["acknowledged"]["by"] == f"{'admin'} (via: console)"
        assert not [a for a in console_overview(gateway, http)["attention"] if a.get("model") == "qc"]
    events = call(gateway, "GET", "/admin/events?model=qc&limit=5")["events"]
    assert events[0]["action"] == "rollout_acknowledged" and events[0]["actor"] == "admin (via: console)"
    again = call(gateway, "POST", "/admin/models/qc/rollout/acknowledge")  # once is enough: nothing changes
    assert again["acknowledged"]["by"] == "admin (via: console)"
    for args, says in ((("rollout", "acknowledge", "qc"), "rolled_back"),
                       (("rollout", "history", "qc"), "acknowledged")):
        ran = subprocess.run([sys.executable, "-m", "gateway", "ctl", "--url", gateway.url, "--token", TOKEN,
                              "--json", *args], capture_output=True, text=True, timeout=60)
        assert ran.returncode == 0 and says in ran.stdout, (args, ran.stdout, ran.stderr)
    kept = call(gateway, "GET", "/admin/models/qc/rollouts")["rollouts"]
    assert kept[0]["state"] == "rolled_back" and kept[0]["acknowledged"]["by"] == "admin (via: console)"
    status, doc = admin_call(gateway.url, "POST", "/admin/models/tok/rollout/acknowledge")
    assert status == 404, doc


def test_a_version_that_is_not_loaded_is_refused_with_how_to_load_it(gateway: GatewayThread) -> None:
    """Friction 7: an unloaded version read 'not known to Triton' with no pointer to loading it.
    (qc's version 4 is in the repository; config.pbtxt serves 1-3.)"""
    # The session Triton is shared: a module before this one may have tried version 4 (it fails to
    # load on purpose), and Triton then lists it UNAVAILABLE: the refusal says so, with the same pointer.
    index = httpx.post(f"{gateway.settings.triton_url}/v2/repository/index", json={}, timeout=10).json()
    tried = any(entry["name"] == "qc" and entry.get("version") == "4" for entry in index)
    status, doc = admin_call(gateway.url, "PATCH", "/admin/models/qc/policy/weights", {"weights": {"2": 90, "4": 10}})
    assert status == 409, doc
    assert doc["error"].startswith("version 4 of model 'qc' is UNAVAILABLE on Triton" if tried else
                                   "version 4 of model 'qc' is not known to Triton (known: 1, 2, 3)"), (tried, doc)
    assert doc["error"].endswith((", not READY: " if tried else ": if the model repository has it, ")
                                 + "load it with `gateway ctl versions load qc 4` "
                                 "(POST /admin/models/qc/versions/4/load)"), doc  # Triton cannot say: 9 is a typo


def test_the_admin_api_says_what_differs_between_a_version_and_the_stable(triton: LocalTriton) -> None:
    """GET /admin/models/{model}/versions/{version}/differences, the API behind the console's version
    page (issue 33, history and differences): against the stable by default, or ?against=; qc's
    version 4 is the sample repository's changed model.py, versions 1-3 share theirs."""
    settings = gateway_settings(triton.http_url, admin_token=TOKEN, policies={"qc": {"weights": {"2": 100}}},
                                model_repository=str(triton.repository))
    with GatewayThread(settings) as gateway:
        four = call(gateway, "GET", "/admin/models/qc/versions/4/differences")
        assert (four["against"], four["against_why"]) == ("2", "the version the policy sends most traffic to")
        assert four["config"]["same"] is True, four  # one config.pbtxt for every version of qc
        assert four["files"]["differing"] == [{"path": "model.py", "change": "changed"}], four["files"]
        one = call(gateway, "GET", "/admin/models/qc/versions/1/differences?against=3")
        assert one["against"] == "3" and one["files"]["differing"] == [], one["files"]
        assert one["files"]["summary"].startswith("every file is the same as in version 3 of qc"), one["files"]
        two = call(gateway, "GET", "/admin/models/qc/versions/2/differences")  # the policy's only version
        assert two["against_why"] == "Triton's newest READY version (the policy sends no traffic to another version)"
        status, doc = admin_call(gateway.url, "GET", "/admin/models/qc/versions/4/differences?against=two%20words")
        assert status in (400, 422) and "error" in doc, (status, doc)
        # a version or model nothing knows is not found (it answered 200: "versions 9 and 2 of qc share" a config)
        for path in ("qc/versions/9/differences", "qc/versions/4/differences?against=9", "qcc/versions/1/differences"):
            status, doc = admin_call(gateway.url, "GET", f"/admin/models/{path}")
            assert status == 404 and "not found: Triton lists no such version and the model repository has no such " \
                "folder" in doc["error"], (path, status, doc)
