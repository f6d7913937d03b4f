"""KServe-v2 over HTTP and Triton's HTTP extensions: the same answer from Triton and through the gateway.

Each call goes to the session's Triton directly and through one gateway (no policies: the
call reaches Triton as the client sent it) and the answers are compared byte for byte: status,
headers, body. What may differ is listed once, in ``differences``.
"""

from __future__ import annotations

import gzip
import json
import struct
import time
import zlib
from typing import Any

import pytest

from gateway.devtools.local_triton import LocalTriton
from tests.compat.http_compare import Answer, assert_same, both, call, raw_exchange, responses_of
from tests.support import TOKEN, GatewayThread

pytestmark = pytest.mark.triton

QC = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
JSON = {"Content-Type": "application/json"}


def body(document: Any) -> bytes:
    return json.dumps(document).encode()


READS = [
    ("GET", "/v2/health/live"), ("GET", "/v2/health/ready"), ("GET", "/v2"),
    ("GET", "/v2/models/qc"), ("GET", "/v2/models/qc/versions/2"), ("GET", "/v2/models/qc/ready"),
    ("GET", "/v2/models/qc/versions/3/ready"), ("GET", "/v2/models/qc/versions/9/ready"),
    ("GET", "/v2/models/nope"), ("GET", "/v2/models/nope/ready"), ("GET", "/v2/models/qc/versions/9"),
    ("GET", "/v2/models/qc/config"), ("GET", "/v2/models/seq/config"), ("GET", "/v2/models/tok/config"),
    ("GET", "/v2/models/qc/versions/2/config"), ("GET", "/v2/models/nope/config"),
    ("GET", "/v2/models/stats"), ("GET", "/v2/models/qc/stats"), ("GET", "/v2/models/qc/versions/1/stats"),
    ("GET", "/v2/models/nope/stats"),
    ("GET", "/v2/trace/setting"), ("GET", "/v2/models/qc/trace/setting"), ("GET", "/v2/logging"),
    ("GET", "/v2/systemsharedmemory/status"), ("GET", "/v2/cudasharedmemory/status"),
    ("GET", "/v2/systemsharedmemory/region/nope/status"),
    ("POST", "/v2/repository/index"), ("GET", "/v2/nope"),
]


@pytest.mark.parametrize(("method", "path"), READS, ids=[f"{m} {p}" for m, p in READS])
def test_reads(triton: LocalTriton, gateway: GatewayThread, method: str, path: str) -> None:
    """Health, server and model metadata, config, statistics, trace and log settings,
    shared-memory status, the repository index, and unknown paths."""
    data = b"{}" if method == "POST" else None
    assert_same(*both(triton.http_url, gateway.url, method, path, data), f"{method} {path}")


INFERS: list[tuple[str, str, Any]] = [
    ("json", "/v2/models/qc/infer", QC),
    ("versioned", "/v2/models/qc/versions/3/infer", QC),
    ("request id and parameters", "/v2/models/qc/infer", {**QC, "id": "r-1", "parameters": {"priority": 0}}),
    ("named output, binary_data false", "/v2/models/qc/infer",
     {**QC, "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}]}),
    ("binary output", "/v2/models/qc/infer",
     {**QC, "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}),
    ("binary_data_output", "/v2/models/qc/infer", {**QC, "parameters": {"binary_data_output": True}}),
    ("wrong shape", "/v2/models/qc/infer", {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 3],
                                                          "data": [1, 2, 3]}]}),
    ("wrong datatype", "/v2/models/qc/infer", {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 4],
                                                             "data": [1, 2, 3, 4]}]}),
    ("unknown input", "/v2/models/qc/infer", {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4],
                                                            "data": [1, 2, 3, 4]}]}),
    ("unknown model", "/v2/models/nope/infer", QC),
    ("unknown version", "/v2/models/qc/versions/9/infer", QC),
    ("version 0", "/v2/models/qc/versions/0/infer", QC),  # not a target a policy can name: still Triton's answer
    ("version 00", "/v2/models/qc/versions/00/infer", QC),
    ("not JSON", "/v2/models/qc/infer", None),
    ("BYTES to a decoupled model", "/v2/models/tok/infer",
     {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}),
    ("generate", "/v2/models/tok/generate", {"text_input": "hi", "max_tokens": 1}),
    ("generate, bad field", "/v2/models/tok/generate", {"text_input": "hi", "max_tokens": "x"}),
]


@pytest.mark.parametrize(("what", "path", "document"), INFERS, ids=[i[0] for i in INFERS])
def test_infer(triton: LocalTriton, gateway: GatewayThread, what: str, path: str, document: Any) -> None:
    data = b"{not json" if document is None else body(document)
    assert_same(*both(triton.http_url, gateway.url, "POST", path, data, JSON), what)


def binary_request() -> tuple[bytes, dict[str, str]]:
    header = body({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4],
                               "parameters": {"binary_data_size": 16}}],
                   "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]})
    return header + struct.pack("<4f", 1, 2, 3, 4), {"Inference-Header-Content-Length": str(len(header)),
                                                     "Content-Type": "application/octet-stream"}


def test_binary_tensor_extension(triton: LocalTriton, gateway: GatewayThread) -> None:
    data, headers = binary_request()
    direct, through = both(triton.http_url, gateway.url, "POST", "/v2/models/qc/infer", data, headers)
    assert direct.status == 200 and "inference-header-content-length" in direct.headers
    assert_same(direct, through, "binary in, binary out")


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_bodies_both_ways(triton: LocalTriton, gateway: GatewayThread, encoding: str) -> None:
    raw = body({**QC, "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}]})
    data = gzip.compress(raw) if encoding == "gzip" else zlib.compress(raw)
    headers = {"Content-Encoding": encoding, "Accept-Encoding": encoding, **JSON}
    direct, through = both(triton.http_url, gateway.url, "POST", "/v2/models/qc/infer", data, headers)
    assert direct.status == 200 and direct.headers.get("content-encoding") == encoding
    assert_same(direct, through, f"{encoding} request and response")


def test_expect_100_continue(triton: LocalTriton, gateway: GatewayThread) -> None:
    data = body(QC)
    payload = (b"POST /v2/models/qc/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(data)) + data
    direct = responses_of(raw_exchange(triton.http_url, payload))
    through = responses_of(raw_exchange(gateway.url, payload))
    assert [r for r in through if r[0] != 100] == [r for r in direct if r[0] != 100]


def test_transfer_encoding_with_content_length(triton: LocalTriton, gateway: GatewayThread) -> None:
    """NVIDIA's own HTTP QA sends both; Triton serves it by the chunked body, and so does the
    gateway (it answered 400), which then closes the connection (RFC 9112 6.3): the request
    pipelined behind it is not read, where Triton answers it too."""
    data = body(QC)
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)
    payload = (b"POST /v2/models/qc/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\nContent-Length: %d\r\n\r\n" % len(data)) + chunked
    behind = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"
    direct = responses_of(raw_exchange(triton.http_url, payload + behind, responses=2))
    through = responses_of(raw_exchange(gateway.url, payload + behind, responses=2))
    assert direct[0][0] == 200 and through == direct[:1], (direct, through)
    answered = raw_exchange(gateway.url, payload)
    assert b"\r\nconnection: close\r\n" in answered.lower(), answered[:300]


def test_pipelined_requests(triton: LocalTriton, gateway: GatewayThread) -> None:
    requests = b""
    documents: list[dict[str, Any]] = [QC, {**QC, "id": "second"}, {"inputs": []}]
    for document in documents:
        data = body(document)
        requests += (b"POST /v2/models/qc/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(data)) + data
    requests += b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"
    direct = responses_of(raw_exchange(triton.http_url, requests, responses=4))
    through = responses_of(raw_exchange(gateway.url, requests, responses=4))
    assert len(direct) == 4 and through == direct


def test_a_keep_alive_connection_idle_for_a_while_still_serves(triton: LocalTriton, gateway: GatewayThread) -> None:
    import http.client

    from tests.compat.http_compare import address, answer

    answers: list[list[Answer]] = []
    for url in (triton.http_url, gateway.url):
        connection = http.client.HTTPConnection(*address(url), timeout=10)
        seen = []
        for pause in (0.0, 2.0):  # under the gateway's (and Triton's) keep-alive timeouts
            time.sleep(pause)
            connection.request("POST", "/v2/models/qc/infer", body=body(QC), headers=JSON)
            seen.append(answer(connection.getresponse()))
        connection.close()
        answers.append(seen)
    for direct, through in zip(*answers, strict=True):
        assert_same(direct, through, "on one kept-alive connection")


def test_generate_stream(triton: LocalTriton, gateway: GatewayThread) -> None:
    document = body({"text_input": "hi", "max_tokens": 3})
    direct, through = both(triton.http_url, gateway.url, "POST", "/v2/models/tok/generate_stream", document, JSON)
    assert direct.status == 200 and direct.body.count(b"data: ") == 3
    assert_same(direct, through, "server-sent events")


def test_http_sequences_oldest_strategy(triton: LocalTriton, gateway: GatewayThread) -> None:
    """The seq model's sequence batcher (oldest strategy): the same running sums either way."""
    direct: list[Answer] = []
    for url, base in ((triton.http_url, 8100), (gateway.url, 8200)):
        results = []
        for step, value in enumerate((1, 2, 3)):
            parameters: dict[str, Any] = {"sequence_id": base}
            if step == 0:
                parameters["sequence_start"] = True
            if step == 2:
                parameters["sequence_end"] = True
            results.append(call(url, "POST", "/v2/models/seq/infer", body(
                {"parameters": parameters, "inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 1],
                                                       "data": [value]}]}), JSON))
        if url == triton.http_url:
            direct = results
        else:
            for mine, theirs in zip(results, direct, strict=True):
                assert_same(theirs, mine, "one step of a sequence")
    unknown = both(triton.http_url, gateway.url, "POST", "/v2/models/seq/infer", body(
        {"parameters": {"sequence_id": 8300}, "inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 1],
                                                          "data": [1]}]}), JSON)
    assert unknown[0].status == 400
    assert_same(*unknown, "a sequence that never started")


CONTROL = [
    ("POST", "/v2/repository/models/tok/load", b"{}"),
    ("POST", "/v2/repository/models/nope/unload", b"{}"),
    ("POST", "/v2/trace/setting", body({"trace_level": ["OFF"]})),
    ("POST", "/v2/logging", body({"log_verbose_level": 0})),
    ("POST", "/v2/systemsharedmemory/region/nope/unregister", b""),
    ("POST", "/v2/systemsharedmemory/region/r1/register", body({"key": "/nope", "offset": 0, "byte_size": 16})),
]


@pytest.mark.parametrize(("method", "path", "data"), CONTROL, ids=[p for _, p, _ in CONTROL])
def test_control_calls_are_denied_or_passed_with_the_admin_token(triton: LocalTriton, gateway: GatewayThread,
                                                                 method: str, path: str, data: bytes) -> None:
    """Documented difference "model control on the data ports": refused without the admin
    token (the gateway's default is deny, so this module's gateway says 403 to everyone) ..."""
    refused = call(gateway.url, method, path, data, JSON)
    assert refused.status == 403 and "error" in refused.json()


@pytest.mark.parametrize(("method", "path", "data"), CONTROL, ids=[p for _, p, _ in CONTROL])
def test_control_calls_with_the_admin_token_reach_triton(triton: LocalTriton, admin_gateway: GatewayThread,
                                                         method: str, path: str, data: bytes) -> None:
    """... with it (triton_control: admin) Triton's own answer, whatever it is ..."""
    direct = call(triton.http_url, method, path, data, JSON)
    through = call(admin_gateway.url, method, path, data, {**JSON, "Authorization": f"Bearer {TOKEN}"})
    assert_same(direct, through, path)
    assert call(admin_gateway.url, method, path, data, JSON).status == 401, "the admin token is needed"


@pytest.mark.parametrize(("method", "path", "data"), CONTROL, ids=[p for _, p, _ in CONTROL])
def test_control_calls_pass_under_allow(triton: LocalTriton, allow_gateway: GatewayThread, method: str, path: str,
                                        data: bytes) -> None:
    """... and under triton_control: allow, Triton's own answer to anyone."""
    assert_same(call(triton.http_url, method, path, data, JSON), call(allow_gateway.url, method, path, data, JSON),
                path)


def test_the_docs_list_the_same_differences() -> None:
    """One list: the table of docs/differences.md is ``DOCUMENTED_DIFFERENCES`` row for row."""
    from pathlib import Path

    from tests.compat.differences import DOCUMENTED_DIFFERENCES

    section = (Path(__file__).resolve().parents[2] / "docs" / "differences.md").read_text()
    rows = [line for line in section.splitlines()
            if line.startswith("| ") and not line.startswith(("| Difference", "| ---"))]
    assert rows == [f"| {name} | {what} |" for name, what in DOCUMENTED_DIFFERENCES]
