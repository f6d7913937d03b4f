"""How `make test` spreads the suite over its parallel workers (pytest-xdist, ``--dist loadgroup``).

A unit of work goes to one worker whole; the units are handed out longest first, so the run does
not end with one worker alone on a minute-long test. A unit is:

- every test that uses ``triton_pair``: the pair is started once, on one worker;
- the tests of the ``HEAVY`` modules, in ``HEAVY_STREAMS`` units of about equal length: they drive
  ~150 req/s or start multi-process gateways and judge rates and latencies, so no more of them run
  at once than there are streams (two, for two cores) while the light tests fill the other workers;
- a module whose tests share a fixture wider than a test (a gateway per module, say), whole;
- otherwise one test.

The lengths are the ones measured in full runs (``EXPECTED_S``, seconds on a quiet 2-core
machine, rounded); a test not listed counts by its directory. The run's summary names the tests
over 20 s missing from the table (tests/run_report.py): add them here.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

# test id (or its prefix without parameters) -> seconds, measured
EXPECTED_S = {
    "tests/integration/test_judge_acceptance.py::test_a_canary_30_percent_slower": 65,
    "tests/integration/test_judge_acceptance.py::test_a_canary_identical_to_the_stable": 55,
    "tests/integration/test_judge_clients.py::test_one_address_aiming_bad_requests_at_an_identical_canary": 60,
    "tests/integration/test_judge_clients.py::test_one_address_with_a_1ms_grpc_deadline_at_an_identical": 45,
    "tests/integration/test_judge_clients.py::test_one_address_with_a_1ms_grpc_deadline_at_the_stable": 42,
    "tests/integration/test_judge_clients.py::test_one_address_aiming_at_the_stable_and_baseline": 38,
    "tests/integration/test_rollout_streaming.py::test_a_streaming_canary_like_the_stable": 46,
    "tests/integration/test_rollout_statistical.py::test_a_canary_like_the_stable_is_promoted": 38,
    "tests/integration/test_rollback_targets.py::test_the_stable_is_protected_and_triton_restarts": 36,
    "tests/integration/test_restore_scope.py::test_loads_on_tritons_own_port": 30,
    "tests/integration/test_workers.py::test_kill_9_of_a_worker_under_load": 40,
    "tests/integration/test_workers.py::test_an_http_sequence_over_fresh_connections": 40,
    "tests/integration/test_workers.py::test_metrics_and_the_judge_count_every_request": 30,
    "tests/integration/test_workers.py::test_a_failing_canary_is_rolled_back_on_every_worker": 28,
    "tests/integration/test_workers.py::test_admission_at_three_times_the_limit": 22,
    "tests/integration/test_replica_windows.py::test_the_holder_judges_every_replicas_traffic": 15,
    "tests/integration/test_workers.py::test_sighup_reloads_and_a_worker_sigterm_under_load": 20,
    "tests/integration/test_workers.py::test_sigterm_under_load_fails_no_request": 14,
    "tests/integration/test_workers.py::test_a_stalled_worker_is_replaced": 14,
    "tests/integration/test_workers_rolling.py::test_a_rolling_update_of_two_replicas": 27,
    "tests/integration/test_state_durability.py::test_ctl_policy_set_changes_only_what_its_flags_name": 25,
    "tests/integration/test_state_durability.py::test_ctl_commands_against_a_running_gateway": 22,
    "tests/integration/test_rollout_gradual.py::test_a_gateway_killed_mid_descent": 23,
    "tests/integration/test_rollback_faults.py::test_a_rollback_lands_while_another_process_holds_the_sqlite": 18,
    "tests/integration/test_rollback_faults.py::test_kill_9_between_the_policy_write": 16,
    "tests/integration/test_rollout.py::test_unloading_the_canary_rolls_back_at_once": 17,
    "tests/integration/test_rollout.py::test_ctl_rollout_commands": 15,
    "tests/integration/test_rollout.py::test_a_gateway_killed_mid_rollout": 12,
    "tests/integration/test_grpc_proxy.py::test_triton_down_gives_unavailable_then_recovers": 16,
    "tests/integration/test_rollout_checks.py::test_prometheus_stopped_mid_rollout": 14,
    "tests/integration/test_upstream_faults.py::test_tritons_queue_full_answer_passes_as_triton_sent_it": 13,
    "tests/integration/test_upstream_faults.py::test_readyz_answers_from_the_live_server_while_another_hangs": 13,
    "tests/integration/test_prometheus.py::test_promql_sees_what_the_recorder_sees": 13,
    "tests/integration/test_prometheus.py::test_a_new_versions_first_errors_count": 10,
    "tests/integration/test_lifecycle_config.py::test_a_fleet_sharing_one_repository": 15,
    "tests/integration/test_http_failures.py::test_triton_stopped_mid_run": 13,
    "tests/integration/test_replica_state.py::test_a_redis_outage_keeps_inference_going": 12,
    "tests/integration/test_replica_state.py::test_a_corrupt_redis_record_is_skipped": 22,
    "tests/integration/test_replica_state.py::test_a_wiped_store_gets_the_config_files_policies": 22,
    "tests/integration/test_hostile_judge.py::test_bad_requests_aimed_at_the_canary": 10,
    "tests/integration/test_grpc_health.py::test_sigterm_tells_watchers_not_serving": 12,
    "tests/integration/test_triton_cli.py::test_a_signal_stops_the_tritonserver": 12,
    "tests/integration/test_interrupted_run.py::test_an_interrupted_parallel_run": 35,
    "tests/console/test_console.py::test_the_page_polls_every_2_s": 13,
    # one browser per module ties each console module's tests into one unit: its tests' sum
    "tests/console/test_console.py": 5,
    "tests/console/test_operator_view.py": 7,
    "tests/abuse/test_messages.py::test_inflations_on_many_streams": 10,
    "tests/abuse/test_stalled_readers.py::test_held_token_replies_cost_about_their_bytes": 15,
    "tests/abuse/test_stalled_readers.py::test_a_reader_slower_than_the_release_is_not_cut": 15,
    "tests/abuse/test_stalled_readers.py": 10,  # most of its tests poll a stalled client ~8 s
    "tests/integration/test_http_proxy.py::test_split_80_20_over_10000": 12,
    "tests/integration/test_fleet.py::test_http_and_grpc_requests_split_evenly_between_two_servers": 35,
    "tests/integration/test_workers_trust.py::test_sighup_applies_tokens_ends_removed_sessions": 50,
    "tests/integration/test_workers_trust.py::test_bodies_tokens_and_metrics_at_the_workers_edge": 45,
    "tests/integration/test_lifecycle.py::test_promotion_unloads_every_previous_version": 12,
    "tests/integration/test_reload.py::test_sighup_applies_tokens_in_one_process": 10,
    "tests/integration/test_lease_failover.py::test_a_rollback_is_applied_within_5_s": 35,
    "tests/integration/test_triton_resets.py::test_streams_cancelled_between_replies_leave_triton_running": 9,
    # issue 34's rollouts against the real Triton (a module's tests share its second Triton)
    "tests/integration/test_warmup.py::test_a_cold_canary_warms_up": 22,
    "tests/integration/test_warmup.py::test_without_a_warm_up": 25,
    "tests/integration/test_verdicts_why.py::": 12,
    "tests/integration/test_version_everywhere.py::test_a_server_serving_another_config": 20,
    "tests/console/test_console_triton.py": 15,
}
HEAVY = ("tests/integration/test_judge_acceptance.py", "tests/integration/test_judge_clients.py",
         "tests/integration/test_rollout_streaming.py", "tests/integration/test_rollout_statistical.py",
         "tests/integration/test_hostile_judge.py", "tests/integration/test_workers.py",
         "tests/integration/test_workers_rolling.py", "tests/integration/test_workers_up.py",
         "tests/integration/test_workers_trust.py", "tests/integration/test_lease_failover.py")
HEAVY_STREAMS = 2
BY_DIRECTORY_S = {"tests/integration/": 2.0, "tests/console/": 3.0, "tests/abuse/": 0.5, "tests/compat/": 0.3}
UNIT_S = 0.05
PAIR_START_S = 20.0  # two Tritons started for the triton_pair unit
# fixtures of the root conftest that every module has: they don't tie a module's tests together
ROOT_FIXTURES = {"session_triton_left_as_found", "descriptors_left_open"}


def expected_s(nodeid: str) -> float:
    bare = nodeid.split("[", 1)[0]
    for known in (nodeid, bare):
        if known in EXPECTED_S:
            return EXPECTED_S[known]
    for prefix, seconds in EXPECTED_S.items():
        if bare.startswith(prefix):
            return seconds
    return next((s for directory, s in BY_DIRECTORY_S.items() if nodeid.startswith(directory)), UNIT_S)


def _shares_wider_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for name, definitions in info.name2fixturedefs.items():
        if name in ROOT_FIXTURES:
            continue
        if any(definition.scope in ("module", "package", "class") for definition in definitions):
            return True
    return False


def unit_of(item: pytest.Item) -> str:
    explicit = item.get_closest_marker("xdist_group")
    if explicit is not None:
        return str(explicit.args[0] if explicit.args else explicit.kwargs.get("name", "default"))
    if "triton_pair" in getattr(item, "fixturenames", ()):
        return "triton_pair"
    module = item.nodeid.split("::", 1)[0]
    if module in HEAVY:
        return "heavy"  # split into HEAVY_STREAMS units below
    return module if _shares_wider_fixture(item) else item.nodeid


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a parallel worker: mark each test with its unit (xdist reads the marks after this hook)
    and order the units longest first (every worker computes the same order)."""
    if not hasattr(config, "workerinput"):
        return
    units: dict[str, list[pytest.Item]] = defaultdict(list)
    streams = [0.0] * HEAVY_STREAMS
    heavy = [item for item in items if unit_of(item) == "heavy"]
    stream_of = {}
    for item in sorted(heavy, key=lambda item: -expected_s(item.nodeid)):  # longest first, to the shorter stream
        lightest = streams.index(min(streams))
        streams[lightest] += expected_s(item.nodeid)
        stream_of[item.nodeid] = f"heavy-{lightest + 1}"
    for item in items:
        unit = stream_of.get(item.nodeid) or unit_of(item)
        if unit != item.nodeid and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(unit))  # a test with no group is a unit of its own
        units[unit].append(item)
    cost = {unit: sum(expected_s(item.nodeid) for item in members) for unit, members in units.items()}
    cost["triton_pair"] = cost.get("triton_pair", 0.0) + PAIR_START_S
    order = sorted(units, key=lambda unit: -cost[unit])  # stable: equal costs keep collection order
    items[:] = [item for unit in order for item in units[unit]]
