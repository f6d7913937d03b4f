"""Issue 33: verdicts state their evidence in words beside the numbers ("evidence 530112x,
needed 600x" is not words)."""

from __future__ import annotations

from gateway.rollout.evidence_words import metric_words, with_words


def metric(**fields: object) -> dict[str, object]:
    return {"name": "latency", "verdict": "fail", "effect": 2.5, "low": 2.1, "high": 2.9, "floor": 0.2,
            "e_value": 530112.0, "e_threshold": 600.0, "requests_needed": None,
            "summary": "latency worse: canary median +250.0% vs stable (+210.0% to +290.0%) over 900 vs 9000 "
                       "samples, beyond the +20% floor (evidence 530112x, needed 600x)", **fields}


def test_a_failed_metric_says_what_was_seen_and_how_sure_in_words() -> None:
    words = metric_words(metric())
    assert words == ("Latency is worse: the canary's median is +250% against the stable's (95% interval +210% to "
                     "+290%); the floor is +20%. The data are 530,112 times likelier if the canary is worse than if "
                     "it is as good as the stable; the judge rolls back from 600 times, a bar a canary as good as "
                     "the stable reaches in at most 1 rollout in 600.")
    assert "530112x" not in words


def test_undecided_and_passed_rates_and_the_baseline_are_named() -> None:
    undecided = metric(name="error_rate", verdict="inconclusive", effect=0.004, low=-0.001, high=0.012,
                       floor=0.01, e_value=12.0, requests_needed=4200)
    assert metric_words(undecided, "baseline") == (
        "Error rate is not decided yet: the canary's rate is +0.40 points against the baseline's (95% interval "
        "-0.10 points to +1.20 points); the floor is +1.00 points; the data are 12.0 times likelier if the canary is "
        "worse, 2% of the way to the 600 times a rollback needs. About 4,200 more canary requests should decide it.")
    leaning = metric(verdict="inconclusive", effect=0.01, e_value=0.3, requests_needed=None)
    assert "lean towards the canary being as good as the stable" in metric_words(leaning)
    assert "no number of requests will decide it" in metric_words(leaning)
    passed = metric(verdict="pass", effect=0.02, low=-0.01, high=0.05)
    assert metric_words(passed).startswith("Latency is fine: the canary's median is +2% against the stable's")
    error = {"name": "check:gpu", "verdict": "error", "summary": "no usable value"}
    assert metric_words(error) == "gpu: no usable value"
    assert with_words({"outcome": "unhealthy", "metrics": [metric()]})["metrics"][0]["words"].startswith("Latency")


def test_a_latency_verdict_says_where_triton_puts_the_difference() -> None:
    from gateway.rollout.evidence_words import with_words

    metric = {"name": "latency", "verdict": "fail", "effect": 0.5, "low": 0.3, "high": 0.7, "floor": 0.2,
              "e_value": 5000.0, "e_threshold": 700.0, "summary": "latency worse"}
    worded = with_words({"metrics": [metric], "attribution": {"cause": "queue"}})["metrics"][0]["words"]
    assert worded.startswith("Latency is worse:") and worded.endswith(
        "Triton's own statistics put the difference in the queue.")
    plain = with_words({"metrics": [metric], "attribution": None})["metrics"][0]["words"]
    assert "Triton" not in plain
    rejected = {**metric, "name": "capacity_error_rate", "effect": 0.05, "low": 0.03, "high": 0.07, "floor": 0.01}
    assert with_words({"metrics": [rejected]})["metrics"][0]["words"].startswith(
        "REJECTED rate (its queue full or timed out) is worse: the canary's rate is +5.00 points")
