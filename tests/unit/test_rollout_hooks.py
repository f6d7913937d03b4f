"""Rollout hooks: the signature, the spec's validation, and delivery against a real local receiver."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.devtools.local_triton import free_port
from gateway.rollout import steps
from gateway.rollout.hook_spec import SIGNATURE_HEADER, sign
from gateway.rollout.hooks import ATTEMPTS, Hooks, payload
from gateway.rollout.spec import RolloutSpec
from tests.support import HookReceiver


def test_signature_is_hmac_sha256_of_the_body() -> None:
    # The RFC 2104 example from Wikipedia's HMAC article: an outside vector, not our own output.
    assert sign(b"The quick brown fox jumps over the lazy dog", "key") == \
        "sha256=f7bc83f430538424b13298e6aa6fb143ef4d59a14946175997479dbc2d1a3cd8"
    assert sign(b"{}", "key") != sign(b"{} ", "key") != sign(b"{}", "other")


@pytest.mark.parametrize(("field", "value", "complaint"), [
    ("webhooks", [{"url": "ftp://example.com/hook"}], "http(s) URL"),
    ("webhooks", [{"url": "http:///no-host"}], "http(s) URL"),
    ("webhooks", [{"url": "http://x/h", "on": ["exploded"]}], "on"),
    ("webhooks", [{"url": "http://x/h", "on": []}], "on"),
    ("webhooks", [{"url": "http://x/h", "secret": ""}], "secret"),
    ("webhooks", [{"url": "http://x/h", "colour": "red"}], "colour"),
    ("gates", [{"url": "http://x/g", "at": "sometimes"}], "at"),
    ("gates", [{"url": "http://x/g"}], "at"),
    ("gates", [{"url": "http://x/g", "at": "each_step", "on_failure": "shrug"}], "on_failure"),
    ("gates", [{"url": "http://x/g", "at": "each_step", "timeout_s": 0}], "timeout_s"),
])
def test_bad_hooks_are_refused(field: str, value: Any, complaint: str) -> None:
    with pytest.raises(ValidationError) as caught:
        RolloutSpec.model_validate({"canary": "3", field: value})
    assert complaint in str(caught.value)


def test_good_hooks_are_kept_with_their_defaults() -> None:
    spec = RolloutSpec.model_validate({"canary": "3", "webhooks": [{"url": "https://ops.example/hook", "secret": "s"}],
                                       "gates": [{"url": "http://127.0.0.1:9/g", "at": "pre_promotion"}]})
    assert spec.webhooks[0].on == ["started", "step", "paused", "resumed", "promoted", "rolled_back", "aborted"]
    assert (spec.gates[0].on_failure, spec.gates[0].timeout_s) == ("hold", 1.0)
    assert RolloutSpec.model_validate(spec.document()) == spec, "the stored form reads back the same"


def rollout_with(**spec: Any) -> steps.Rollout:
    return steps.begin("qc", RolloutSpec.model_validate({"canary": "3", "steps": [10, 100], **spec}), "2", 1000.0)


def test_webhook_is_retried_signed_and_counted() -> None:
    with HookReceiver() as receiver:
        receiver.answers["/hook"] = [500, 503, 200]
        rollout = rollout_with(webhooks=[{"url": receiver.url("/hook"), "secret": "s3cret", "on": ["started"]}])

        async def run() -> dict[str, Any]:
            hooks = Hooks(time.time, first_backoff_s=0.01)
            hooks.notify(rollout, "started")
            hooks.notify(rollout, "step")  # not asked for: never sent
            for _ in range(200):
                if hooks.status("qc")["delivered"]:
                    break
                await asyncio.sleep(0.02)
            await hooks.close()
            return hooks.status("qc")

        status = asyncio.run(run())
    assert status["delivered"] == 1 and status["failures"] == 0
    assert len(receiver.posts) == 3, "two failed attempts, then the one that got through"
    _, headers, body = receiver.posts[-1]
    assert headers[SIGNATURE_HEADER] == "sha256=" + hmac.new(b"s3cret", body, hashlib.sha256).hexdigest()
    doc = receiver.bodies("/hook")[-1]
    assert (doc["event"], doc["model"], doc["stable"], doc["canary"], doc["step"], doc["weights"]) == \
        ("started", "qc", "2", "3", 1, {"2": 90, "3": 10})


def test_an_unreachable_webhook_shows_in_the_status() -> None:
    rollout = rollout_with(webhooks=[{"url": f"http://127.0.0.1:{free_port()}/gone"}])

    async def run() -> dict[str, Any]:
        hooks = Hooks(time.time, first_backoff_s=0.01)
        hooks.notify(rollout, "promoted")
        for _ in range(200):
            if hooks.status("qc")["failures"]:
                break
            await asyncio.sleep(0.02)
        await hooks.close()
        return hooks.status("qc")

    status = asyncio.run(run())
    assert status["failures"] == 1 and status["delivered"] == 0
    assert "/gone" in status["last_error"] and f"{ATTEMPTS} attempts" in status["last_error"]


def test_gates_pass_on_2xx_and_refuse_anything_else_within_the_limit() -> None:
    with HookReceiver() as receiver:
        receiver.answers["/refuse"] = [409]
        receiver.delay_s["/slow"] = 1.5
        ok = rollout_with(gates=[{"url": receiver.url("/ok"), "at": "each_step"}])
        refusing = rollout_with(gates=[{"url": receiver.url("/ok"), "at": "each_step"},
                                       {"url": receiver.url("/refuse"), "at": "each_step"}])
        slow = rollout_with(gates=[{"url": receiver.url("/slow"), "at": "pre_promotion", "timeout_s": 30}])

        async def run() -> tuple[Any, ...]:
            hooks = Hooks(time.time)
            results = [await hooks.refusal(ok, ("each_step",), 2.0),
                       await hooks.refusal(ok, ("pre_promotion",), 2.0),
                       await hooks.refusal(refusing, ("each_step",), 2.0)]
            started = time.monotonic()
            timed_out = await hooks.refusal(slow, ("pre_promotion",), 0.3)
            took = time.monotonic() - started
            await hooks.close()
            return (*results, timed_out, took)

        passed, not_asked, refused, timed_out, took = asyncio.run(run())
    assert passed is None and not_asked is None
    assert refused is not None and refused[0].url.endswith("/refuse") and refused[1] == "answered 409"
    assert timed_out is not None and timed_out[1] == "no answer within 0.3s"
    # the gate's own timeout is 30 s: 10 s leaves the thread room on a loaded machine and still
    # tells the two apart (the error above names the limit that applied, too)
    assert took < 10, "the limit (the controller's call timeout) wins over the gate's own timeout"
    assert receiver.bodies("/ok")[0]["event"] == "gate" and receiver.bodies("/ok")[0]["at"] == "each_step"


def test_payload_carries_the_last_verdict() -> None:
    import json

    from gateway.rollout.analysis import Outcome, Verdict

    rollout = rollout_with()
    judged = steps.on_verdict(rollout, Verdict(Outcome.HEALTHY, "fine", canary_requests=7), 1031.0)
    doc = json.loads(payload(judged, "step", 1031.0))
    assert doc["step"] == 2 and doc["weights"] == {"2": 0, "3": 100}
    assert doc["verdict"]["outcome"] == "healthy" and doc["verdict"]["canary_requests"] == 7 and doc["time"] == 1031.0
