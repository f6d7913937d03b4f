"""The README and the docs are tested: every shell block in README.md and docs/*.md that talks
to a running gateway is run.

Each block is taken from its page as it is (nothing here repeats its commands), run by bash
against a fresh gateway started the way the README's "Running it by hand" block starts it
(``gateway serve --config configs/gateway.yaml`` with the README's admin token), in front of
the session's real Triton (standing in for the block's ``gateway triton`` line: the same
``LocalTriton``). Only addresses are substituted: ``localhost:8080`` becomes the gateway's
free port, ``gateway ctl`` finds the gateway through ``GATEWAY_CTL_URL``, and ``.venv/bin/``
is this environment's. A block passes when bash exits 0 and every JSON document it printed
is an answer, not an ``{"error": ...}``. Shell variables set by one block (``H=...``) are
set for the blocks after it, as for a reader going down the page; a docs page starts with the
README's (a reader comes to the docs from the README).

Also here: the admin API reads a JSON body sent as ``curl -d`` sends it (no Content-Type, or
``application/x-www-form-urlencoded``) and refuses other media types with 415.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from gateway.devtools.local_triton import LocalTriton, dies_with_parent
from tests.integration.test_tls import Pki, pki  # noqa: F401 (the fixture: a CA and a server certificate)
from tests.support import (
    GatewayProcess,
    GatewayThread,
    admin_call,
    gateway_settings,
    pipe_as_in_the_repository,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
# Blocks that talk to a running gateway: they name its address or its CLI.
GATEWAY_MARKERS = ("localhost:8080", "gateway ctl", "gateway:8080", "gateway:8081")
SERVER_LINES = re.compile(r"^\s*(\S+=\S+\s+)*(\.venv/bin/)?gateway (triton|serve)\b")
WATCH_S = 3  # a `--watch` line follows a rollout until it ends: it must print its first status within this


class Block(NamedTuple):
    page: Path
    line: int
    text: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def shell_blocks(page: Path) -> list[Block]:
    """Every ```sh / ```bash block of a page, with the line it starts on."""
    blocks: list[Block] = []
    current: list[str] | None = None
    start = 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if current is None and re.fullmatch(r"```(sh|bash)\s*", line):
            current, start = [], number
        elif current is not None and line.strip() == "```":
            blocks.append(Block(page, start, "\n".join(current)))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


GATEWAY_BLOCKS = [b for page in PAGES for b in shell_blocks(page) if any(m in b.text for m in GATEWAY_MARKERS)]
# Blocks about a TLS gateway, named "gateway" by DNS: run against a gateway with a certificate for that name.
TLS_BLOCKS = [b for b in GATEWAY_BLOCKS if "--cacert" in b.text or "ssl=True" in b.text]


def is_ensemble_canary(block: Block) -> bool:
    """docs/ensembles.md's five commands: run one by one, and checked against their comments, by
    test_the_ensemble_canary_in_five_commands_does_what_its_comments_say (not twice)."""
    return block.page.name == "ensembles.md" and "--composing" in block.text


RUN_WHOLE = [b for b in GATEWAY_BLOCKS if b not in TLS_BLOCKS and not is_ensemble_canary(b)]


def test_the_pages_have_gateway_blocks_and_every_one_is_run() -> None:
    """A test that quietly found no block would pass for ever: the pages must still have them,
    the README its serve line and its first canary."""
    assert len(GATEWAY_BLOCKS) >= 8, [b.name for b in GATEWAY_BLOCKS]
    readme = [b for b in GATEWAY_BLOCKS if b.page == README]
    assert any("gateway serve" in b.text for b in readme), "the README's block that starts the gateway"
    assert any("rollout start" in b.text for b in readme), "the README's first canary"
    assert len([b for b in GATEWAY_BLOCKS if is_ensemble_canary(b)]) == 1, "docs/ensembles.md's five commands"


def serve_environment(block: str) -> dict[str, str]:
    """The environment the README's serve line sets (GATEWAY_ADMIN_TOKEN=...)."""
    for line in block.splitlines():
        if SERVER_LINES.match(line) and " serve" in line:
            return dict(re.findall(r"(\w+)=(\S+)\s", line.split("gateway serve")[0] + " "))
    raise AssertionError("no `gateway serve` line in the README's first gateway block")


def serve_config(block: str) -> Path:
    match = re.search(r"gateway serve --config (\S+)", block)
    assert match, "the serve line names its config file"
    return ROOT / match.group(1)


SERVE_BLOCK = next(b.text for b in GATEWAY_BLOCKS if b.page == README and "gateway serve" in b.text)


class ServeLine(GatewayProcess):
    """The README's serve line as a child process: ``gateway serve --config <file>``, with the
    environment's GATEWAY_* (ports, Triton) over the file, as the file's header says they win."""

    def __init__(self, env: dict[str, str], config: Path) -> None:
        super().__init__(env)
        self.config = config

    def start(self) -> ServeLine:
        self.process = subprocess.Popen([str(BIN / "gateway"), "serve", "--config", str(self.config)], env=self.env,
                                        preexec_fn=dies_with_parent())
        return self.wait_ready()


def serve_line(triton: LocalTriton, directory: Path) -> ServeLine:
    """A gateway as the README's serve line starts it: its config file, its token; the session
    Triton's address, free ports, and a Prometheus address for the rollout checks block (nothing
    listens there: a check is evaluated each interval, not at start)."""
    env = {**serve_environment(SERVE_BLOCK), "GATEWAY_TRITON_URL": triton.http_url,
           "GATEWAY_TRITON_GRPC_URL": triton.grpc_url, "GATEWAY_STORE_URL": f"sqlite:///{directory / 'state.db'}",
           "GATEWAY_PROMETHEUS_URL": "http://127.0.0.1:9"}
    for attempt in range(3):  # a free port taken by another process before the gateway binds it: new ports
        try:
            return ServeLine(env, serve_config(SERVE_BLOCK)).start()
        except RuntimeError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@pytest.fixture
def readme_gateway(target_models: LocalTriton, tmp_path: Path) -> Iterator[GatewayProcess]:
    """A fresh gateway for each block: each block reads as a story of its own (the sample's
    ensemble and per-version model loaded, as `make demo` serves them; the ensemble put back as
    the repository has it after each block: a block may leave a canary inside it)."""
    gateway = serve_line(target_models, tmp_path)
    try:
        yield gateway
    finally:
        gateway.stop()
        pipe_as_in_the_repository(target_models)


@pytest.fixture(scope="module")
def media_gateway(triton: LocalTriton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    gateway = serve_line(triton, tmp_path_factory.mktemp("media"))
    try:
        yield gateway
    finally:
        gateway.stop()


def runnable(block: str, gateway: GatewayProcess) -> str:
    """The block with its server lines left out (the fixture runs them) and addresses substituted;
    a `--watch` line runs for WATCH_S."""
    lines = []
    for line in block.splitlines():
        if SERVER_LINES.match(line):
            continue
        line = line.replace("localhost:8080", f"127.0.0.1:{gateway.port}").replace(".venv/bin/", f"{BIN}/")
        if "--watch" in line:
            line = f"timeout {WATCH_S} {line.split(' #')[0]} || [ $? = 124 ]"
        lines.append(line)
    return "\n".join(lines)


def variables_before(block: Block) -> str:
    """Shell variables earlier blocks set (H=..., export X=...), for a reader going down the page
    (on a docs page: the README's first)."""
    earlier = [] if block.page == README else shell_blocks(README)
    earlier += [b for b in shell_blocks(block.page) if b.line < block.line]
    out = []
    for previous in earlier:
        out += [row for row in previous.text.splitlines()
                if re.fullmatch(r"""(export )?[A-Z_]+=('[^']*'|"[^"]*"|\S+)\s*(#.*)?""", row)]
    return "\n".join(out)


def json_documents(text: str) -> list[Any]:
    decoder, found, at = json.JSONDecoder(), list[Any](), 0
    while True:
        at = text.find("{", at)
        if at < 0:
            return found
        try:
            document, end = decoder.raw_decode(text, at)
        except ValueError:
            at += 1
            continue
        found.append(document)
        at = end


def run_block(block: Block, text: str, gateway: GatewayProcess) -> tuple[subprocess.CompletedProcess[str], str]:
    """``text`` (the block, or some of its lines) run by bash as a reader of the block's page would."""
    script = "set -euo pipefail\n" + variables_before(block) + "\n" + runnable(text, gateway)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "GATEWAY_CTL_URL": gateway.url}
    result = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return result, f"{block.name} exited {result.returncode}\n--- ran:\n{script}\n--- out:\n{result.stdout}\n" \
        f"--- err:\n{result.stderr}"


@pytest.mark.parametrize("block", RUN_WHOLE, ids=[b.name for b in RUN_WHOLE])
def test_readme_block_runs(block: Block, readme_gateway: GatewayProcess) -> None:
    result, shown = run_block(block, block.text, readme_gateway)
    assert result.returncode == 0, shown
    documents = json_documents(result.stdout)
    assert documents or "gateway ctl" in block.text, shown
    errors = [doc for doc in documents if isinstance(doc, dict) and "error" in doc]
    assert not errors, shown


def test_the_ensemble_canary_in_five_commands_does_what_its_comments_say(readme_gateway: GatewayProcess,
                                                                          target_models: LocalTriton) -> None:
    """docs/ensembles.md's block is five commands, run one at a time as above, each doing what its
    comment says: pipe answers QC_VERSION 2; the start loads pipe__qc_3 in Triton and sends it 20%
    of pipe; the status shows the rollout; the abort unloads the variant again; the events list it.
    (It is the one block test_readme_block_runs leaves out: that test only checks a block succeeds.)"""
    block = next(b for b in GATEWAY_BLOCKS if is_ensemble_canary(b))
    commands = [line for line in block.text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) == 5, commands
    token = serve_environment(SERVE_BLOCK)["GATEWAY_ADMIN_TOKEN"]

    def run(command: str) -> str:
        result, shown = run_block(block, command, readme_gateway)
        assert result.returncode == 0, shown
        return result.stdout

    def variant_ready() -> int:
        try:
            with urllib.request.urlopen(f"{target_models.http_url}/v2/models/pipe__qc_3/ready", timeout=10) as r:
                return int(r.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    answer = json.loads(run(commands[0]))
    assert answer["model_name"] == "pipe" and next(
        o["data"] for o in answer["outputs"] if o["name"] == "QC_VERSION") == [2], answer
    run(commands[1])
    assert variant_ready() == 200
    status, policy = admin_call(readme_gateway.url, "GET", "/admin/models/pipe/policy", token=token)
    assert status == 200 and policy["weights"] == {"1": 80, "pipe__qc_3": 20}, policy
    assert "pipe__qc_3" in run(commands[2])
    run(commands[3])
    wait_for(lambda: variant_ready() != 200, 20, what="the variant to be unloaded")
    shown = run(f"COLUMNS=200 {commands[4]}")  # rich's table fits the width: a reader's terminal, not 80
    assert all(action in shown for action in ("rollout_started", "variant_unloaded")), shown


@pytest.mark.parametrize("block", TLS_BLOCKS, ids=[b.name for b in TLS_BLOCKS])
def test_readme_tls_block_runs(block: Block, triton: LocalTriton, pki: Pki, tmp_path: Path) -> None:  # noqa: F811
    """The TLS clients' block, against a gateway serving TLS on both ports with a certificate
    for localhost (the block's host "gateway" is an address, substituted like the others), run
    where the block expects the CA's certificate: ./ca.crt."""
    (tmp_path / "ca.crt").write_bytes(pki.ca.read_bytes())
    settings = gateway_settings(triton.http_url, triton_grpc_url=triton.grpc_url, tls_cert_file=pki.server_cert,
                                tls_key_file=pki.server_key)
    with GatewayThread(settings) as gw:
        script = "set -euo pipefail\n" + block.text.replace("gateway:8080", f"localhost:{settings.port}") \
            .replace("gateway:8081", f"localhost:{settings.grpc_port}")
        env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        result = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=60)
    assert result.returncode == 0 and result.stdout.strip().endswith("True"), (gw.url, result)


# -- the admin API's media types -------------------------------------------------------------------
def admin_put(gateway: GatewayProcess, body: bytes, content_type: str | None) -> tuple[int, Any]:
    headers = {"Authorization": "Bearer " + serve_environment(SERVE_BLOCK)["GATEWAY_ADMIN_TOKEN"]}
    if content_type is not None:
        headers["Content-Type"] = content_type
    request = urllib.request.Request(f"{gateway.url}/admin/models/qc/policy", data=body, method="PUT",
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "application/json",
                                          "application/json; charset=utf-8", "application/merge-patch+json"])
def test_the_admin_api_reads_json_as_curl_sends_it(media_gateway: GatewayProcess, content_type: str | None) -> None:
    """``curl -d`` says application/x-www-form-urlencoded; a script may send no Content-Type at all:
    both were answered 422 "Input should be a valid dictionary"."""
    status, answer = admin_put(media_gateway, b'{"weights": {"2": 70, "3": 30}}', content_type)
    assert status == 200 and answer["weights"] == {"2": 70, "3": 30}, answer


@pytest.mark.parametrize("content_type", ["text/plain", "application/xml", "multipart/form-data; boundary=x"])
def test_other_media_types_are_refused_with_415_and_change_nothing(media_gateway: GatewayProcess,
                                                                   content_type: str) -> None:
    before = admin_put(media_gateway, b'{"weights": {"2": 60, "3": 40}}', None)[1]["revision"]
    status, answer = admin_put(media_gateway, b'{"weights": {"2": 10, "3": 90}}', content_type)
    assert status == 415 and content_type.split(";")[0] in answer["error"], answer
    with urllib.request.urlopen(urllib.request.Request(
            f"{media_gateway.url}/admin/models/qc/policy",
            headers={"Authorization": "Bearer " + serve_environment(SERVE_BLOCK)["GATEWAY_ADMIN_TOKEN"]})) as r:
        assert json.loads(r.read())["revision"] == before, "nothing changed"
