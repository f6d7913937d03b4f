"""The suite's shared fixtures. `make test` runs it in parallel (pytest-xdist, several worker
processes, whole modules per worker); a plain `pytest FILE` runs in one process.

How to write a parallel-safe test:

- **Ports**: only ``free_port()`` / ``LocalTriton.on_free_ports()`` (gateway.devtools.local_triton),
  127.0.0.1 only. Each worker draws from a slice of its own ($FREE_PORT_RANGE, set below), and so
  do the servers it starts; never a fixed port, never bind(0) for a server the test does not bind.
- **Triton**: each worker has its own session Triton (fixture ``triton``) and its own faults file
  (fixture ``faults``, cleared after each test). The tests of one worker run one at a time, so a
  test may set faults and load or unload versions on it, provided it puts back what it changed
  (``session_triton_left_as_found`` reloads and names a module that did not). Never write into
  ``deploy/model_repository``: every worker's Triton serves it; copy it to ``tmp_path`` first
  (as ``triton_pair`` does). Start a Triton of your own only for what the shared one cannot give:
  a restart or kill, a different repository or config, a second fleet member (``triton_pair``).
- **Redis**: fixture ``redis_url``, a database of its own per test on the worker's redis-server.
- **State**: files under ``tmp_path``; ``store_url`` defaults to ``memory://`` in gateway_settings.
  Nothing in the working tree but test-artifacts/ under a name of the test's own.
- **Waiting**: no fixed sleeps; ``wait_for`` a condition or an event, short rollout intervals
  where the property does not depend on their length. A test over 30 s says why in its docstring
  (the run's summary names those that don't).
- **Processes**: stop what you start in a ``finally`` or a fixture; an interrupted run (Ctrl-C,
  SIGTERM) tears fixtures down, so start servers from fixtures or context managers.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest

from gateway.devtools.local_triton import PORT_RANGE_VARIABLE, TARGET_MODELS, LocalTriton, dies_with_parent, port_slice

# in this order: the report imports the schedule
pytest_plugins = ["tests.schedule", "tests.run_report", "tests.interrupts"]

# No per-example deadline (Hypothesis's default is 200 ms): it times each example, and with parallel
# workers on 2 cores a 0.25 ms example once took 265 ms and failed a property that held. A property
# is proven by its assertions; a test that means a time bound sets its own deadline.
hypothesis.settings.register_profile("suite", deadline=None)
hypothesis.settings.load_profile("suite")


def pytest_configure(config: pytest.Config) -> None:
    """A parallel worker draws its ports from a slice of its own below the ephemeral range; the
    servers it starts inherit the slice through the environment."""
    given: dict[str, Any] = getattr(config, "workerinput", {})  # set by xdist in a worker
    if "workerid" in given:
        index = int(given["workerid"].removeprefix("gw"))
        os.environ[PORT_RANGE_VARIABLE] = port_slice(index, int(given["workercount"]))


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read GATEWAY_* variables: no test may see another's or the developer's."""
    for name in list(os.environ):
        if name.startswith("GATEWAY_"):
            monkeypatch.delenv(name)


class Faults:
    """Writes the sample models' fault file; the running Triton re-reads it within ~100 ms."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.clear()

    def set(self, model: str, version: str, **spec: Any) -> None:
        data = json.loads(self.path.read_text())
        data.setdefault(model, {})[version] = spec
        self._write(data)

    def clear(self) -> None:
        self._write({})

    def _write(self, data: dict[str, Any]) -> None:
        if json.loads(self.path.read_text()) == data:
            return  # the models hold this already: no write, no wait (every test using faults paid 0.5 s)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)
        time.sleep(0.25)  # the models check the file at most every 100 ms


@pytest.fixture(scope="session")
def faults_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "faults.json"
    path.write_text("{}")
    return path


@pytest.fixture(scope="session")
def triton(faults_path: Path) -> Iterator[LocalTriton]:
    """One real tritonserver for the whole session, on free ports."""
    server = LocalTriton.on_free_ports(faults_file=faults_path)
    with server:
        _session_triton.append((server, _ready_versions(server)))
        yield server
        _session_triton.clear()
        if server.returncode is not None:  # died under the worker's last module
            died_in(server, "the session's last module")


def died_in(server: LocalTriton, where: str, lines: int = 25) -> None:
    """The last lines of a session Triton's log that ended by itself (a crash prints "Signal (11)
    received." and a backtrace there), for the run's summary: its log goes with its temporary
    directory when it is stopped."""
    from tests import run_report

    try:
        logged = server.log_path.read_text(errors="replace").splitlines()
        tail = [line for line in logged if not line.startswith(("|", "+-"))][-lines:]  # not the settings table
    except OSError as exc:
        tail = [f"(no log: {exc})"]
    run_report.note(run_report.TRITON_DIED, "\n".join([f"{where}: exit status {server.returncode}, the log's last "
                                                        f"{len(tail)} lines:", *(f"    {line}" for line in tail)]))


# The session Triton, and the versions READY on it at the start (every model). Many modules
# assume qc's 1, 2 and 3: one CI run lost version 1 before test_grpc_proxy.py (which module
# unloaded it is unknown; it did not recur in isolation) and 15 tests in 6 later modules failed.
_session_triton: list[tuple[LocalTriton, dict[str, set[str]]]] = []


def _unready_reasons(server: LocalTriton, model: str) -> str:
    """What Triton's index says of ``model``'s versions that are not READY (why a stub died, say)."""
    import urllib.request

    request = urllib.request.Request(f"{server.http_url}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        index = json.loads(response.read())
    return "; ".join(f"version {entry.get('version', '?')} {entry.get('state')}: {entry.get('reason', '')}"[:400]
                     for entry in index if entry.get("name") == model) or "not in Triton's index"


def _ready_versions(server: LocalTriton) -> dict[str, set[str]]:
    import urllib.request

    request = urllib.request.Request(f"{server.http_url}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        index = json.loads(response.read())
    ready: dict[str, set[str]] = {}
    for entry in index:
        if entry.get("state") == "READY" and "version" in entry:
            ready.setdefault(entry["name"], set()).add(entry["version"])
    return ready


@pytest.fixture(autouse=True, scope="module")
def session_triton_left_as_found(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each module: a session Triton serving other versions than at the start is put back
    (each changed model loaded again with the versions it had) and the module is named in the
    summary, so one module's leftover fails no other module and the culprit shows in the log."""
    yield
    for server, wanted in list(_session_triton):
        if server.returncode is not None:  # it died under this module: started again, named in the summary
            from tests import run_report

            run_report.note(run_report.LEFT_CHANGED, f"{request.node.nodeid}: the session Triton exited with "
                                                     f"{server.returncode}; started again on its ports")
            died_in(server, request.node.nodeid)
            server.stop()
            server.start()
        try:
            found = _ready_versions(server)
        except OSError:
            return  # stopped or restarting: the module that did it restarts it
        changed = sorted(model for model in wanted.keys() | found.keys() if wanted.get(model) != found.get(model))
        if not changed:
            return
        left = f"{request.node.nodeid}: " + "; ".join(
            f"{model} READY {sorted(found.get(model, ()))}, was {sorted(wanted.get(model, ()))}" for model in changed)
        from tests import run_report

        run_report.note(run_report.LEFT_CHANGED, left)
        import urllib.error
        import urllib.request

        for model in changed:  # Triton keeps a config given with a load: the versions are given back the same way
            try:
                with urllib.request.urlopen(f"{server.http_url}/v2/models/{model}/config", timeout=10) as response:
                    config = json.loads(response.read())
            except urllib.error.HTTPError as exc:  # no version of it is READY: Triton has no config to give
                if exc.code != 404:
                    raise
                run_report.note(run_report.LEFT_CHANGED, f"{request.node.nodeid}: {model}: "
                                                         f"{_unready_reasons(server, model)}")
                body = b"{}"  # loaded again from the repository's own config.pbtxt
            else:
                config["version_policy"] = {"specific": {"versions": sorted(int(v) for v in wanted.get(model, ()))}}
                body = json.dumps({"parameters": {"config": json.dumps(config)}}).encode()
            load = urllib.request.Request(f"{server.http_url}/v2/repository/models/{model}/load", data=body,
                                          method="POST")
            urllib.request.urlopen(load, timeout=120).close()
        deadline = time.monotonic() + 60
        while _ready_versions(server) != wanted:
            assert time.monotonic() < deadline, f"the session Triton could not be put back: {left}"
            time.sleep(0.2)


@pytest.fixture(scope="session")
def target_models(triton: LocalTriton) -> LocalTriton:
    """The session's Triton with TARGET_MODELS loaded as well (qc_2026_12; pipe with pre and
    post), once per session and only where a test needs them: every other test's Triton starts
    without their five Python stubs. They count as found from then on (the module check above)."""
    import urllib.request

    for model in TARGET_MODELS:
        load = urllib.request.Request(f"{triton.http_url}/v2/repository/models/{model}/load", data=b"{}",
                                      method="POST")
        urllib.request.urlopen(load, timeout=120).close()
    for server, wanted in _session_triton:
        if server is triton:
            wanted.update({model: versions for model, versions in _ready_versions(server).items()
                           if model not in wanted})
    return triton


@pytest.fixture(autouse=True, scope="module")
def descriptors_left_open(request: pytest.FixtureRequest) -> Iterator[None]:
    """The test process' open descriptors before and after each module (after a collection, so
    what is merely unreferenced is closed): the modules that leave most open are named in the
    summary. A full run passed 1024 of them late; this says which modules to look at."""
    import gc

    before = len(os.listdir("/proc/self/fd"))
    yield
    gc.collect()
    left = len(os.listdir("/proc/self/fd")) - before
    if left >= 5:
        from tests import run_report

        run_report.note(run_report.DESCRIPTORS, f"{left:5d}  {request.node.nodeid}", left)


@pytest.fixture
def faults(triton: LocalTriton, faults_path: Path) -> Iterator[Faults]:
    helper = Faults(faults_path)
    yield helper
    helper.clear()


REDIS_DATABASES = 4096
_redis_databases = itertools.count(16)  # 0-15 stay free for tests that pick one by hand


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port for the whole session (never skipped:
    `make test` installs Debian's redis-server when it is missing)."""
    import shutil
    import socket
    import subprocess

    from gateway.devtools.local_triton import free_port

    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed: run the suite through `make test`"
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                "--databases", str(REDIS_DATABASES), "--dir", str(workdir)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, preexec_fn=dies_with_parent())
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                process.kill()
                raise
            time.sleep(0.05)
    try:
        yield f"redis://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """A clean database of its own for each test: a gateway an earlier test failed to stop
    keeps syncing into that test's database, and once wrote a config policy into a later test's
    (a new-store generation after the flush), so no two tests share one."""
    import redis

    database = next(_redis_databases)
    client = redis.Redis.from_url(f"{redis_server}/{database}")
    client.flushdb()
    client.close()
    return f"{redis_server}/{database}"


class PrometheusServer:
    """A real Prometheus (Debian's package) scraping the given targets every second."""

    def __init__(self, workdir: Path, targets: dict[str, str]) -> None:
        import shutil

        from gateway.devtools.local_triton import free_port

        binary = shutil.which("prometheus")
        assert binary, "prometheus is not installed: run the suite through `make test`"
        self.port = free_port()
        config = workdir / "prometheus.yml"
        jobs = "".join(f"  - job_name: {job}\n    static_configs: [{{targets: ['{target}']}}]\n"
                       for job, target in targets.items())
        config.write_text(f"global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nscrape_configs:\n{jobs}")
        import subprocess

        self.process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            preexec_fn=dies_with_parent())
        deadline = time.monotonic() + 20
        while True:
            try:
                import urllib.request

                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError("prometheus did not become ready") from None
                time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def query(self, promql: str) -> list[dict[str, Any]]:
        import urllib.parse
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})) as r:
            return list(json.loads(r.read())["data"]["result"])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(15)


@pytest.fixture(scope="session")
def exported_metric_names(triton: LocalTriton) -> set[str]:
    """Every sample name the gateway and Triton really export, after some traffic."""
    import asyncio
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from gateway.rollout.controller import PHASES
    from tests.support import GatewayThread, drive, gateway_settings

    settings = gateway_settings(triton.http_url, admin_token="exported-names-token",
                                policies={"qc": {"weights": {"2": 100}}})
    names: set[str] = set()
    with GatewayThread(settings) as gw:
        asyncio.run(drive(gw.url, 20, concurrency=2))
        gw.app.recorder.upstream_error("qc", "2", "probe")
        gw.app.recorder.set_rollout_state("qc", "progressing", PHASES)
        gw.app.recorder.count_rollback("qc", "probe")
        for url in (f"{gw.url}/metrics", triton.metrics_url):
            text = urllib.request.urlopen(url).read().decode()
            for family in text_string_to_metric_families(text):
                names.add(family.name)
                names |= {sample.name for sample in family.samples}
    return names


@pytest.fixture(scope="session")
def triton_pair(faults_path: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalTriton, LocalTriton]]:
    """Two real tritonservers for the fleet tests. Server A's repository has one version more than
    B's (qc/5, a healthy copy of qc/2, not loaded at start) so a load can fail on one server only."""
    import shutil

    from gateway.devtools.local_triton import SAMPLE_REPOSITORY

    repository = tmp_path_factory.mktemp("fleet-a") / "models"
    shutil.copytree(SAMPLE_REPOSITORY, repository)
    shutil.copytree(repository / "qc" / "2", repository / "qc" / "5")
    with LocalTriton.on_free_ports(repository=repository, faults_file=faults_path) as first:
        with LocalTriton.on_free_ports(faults_file=faults_path) as second:  # ports picked after first's are taken
            yield first, second
