"""TLS on both data ports (HTTPS, gRPC over TLS with ALPN h2), mTLS, and TLS to Triton, with a CA made here.

No fake upstream: "Triton over TLS" is a second gateway serving TLS in front of the real Triton
(Triton's HTTP server has no TLS of its own), so the chain is
client -> gateway A -> (https / grpcs, client certificate) -> gateway B -> Triton.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from tritonclient.utils import InferenceServerException

from gateway.devtools.local_triton import LocalTriton
from gateway.settings import Settings, SettingsError
from tests.support import GatewayThread, gateway_settings

pytestmark = pytest.mark.triton


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, issuer_key: ec.EllipticCurvePrivateKey,
           *, ca: bool = False, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
    if not ca:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(directory: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[Path, Path]:
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _issue("test CA", ca_key, _name("test CA"), ca_key, ca=True)
    ca_path, _ = _write(directory, "ca", ca_cert, ca_key)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    server = _write(directory, "server", _issue("gateway", server_key, ca_cert.subject, ca_key, server=True),
                    server_key)
    client = _write(directory, "client", _issue("client", client_key, ca_cert.subject, ca_key), client_key)
    return Pki(ca_path, *server, *client)


def tls_settings(triton: LocalTriton, pki: Pki, mtls: bool, **values: object) -> Settings:
    values.setdefault("triton_grpc_url", triton.grpc_url)
    return gateway_settings(values.pop("triton_url", triton.http_url), tls_cert_file=pki.server_cert,  # type: ignore[arg-type]
                            tls_key_file=pki.server_key, tls_client_ca_file=pki.ca if mtls else None,
                            policies={"qc": {"weights": {"2": 100}}}, **values)


def http_infer(url: str, **client: object) -> str:
    tensor = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    with_client = httpclient.InferenceServerClient(url, **client)
    try:
        return str(with_client.infer("qc", [tensor]).get_response()["model_version"])
    finally:
        with_client.close()


def grpc_infer(url: str, **client: object) -> str:
    tensor = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    with_client = grpcclient.InferenceServerClient(url, **client)
    try:
        return str(with_client.infer("qc", [tensor], client_timeout=10).get_response().model_version)
    finally:
        with_client.close()


@pytest.fixture(params=["lean", "grpcio"])
def mtls_gateway(request: pytest.FixtureRequest, triton: LocalTriton, pki: Pki) -> Iterator[GatewayThread]:
    with GatewayThread(tls_settings(triton, pki, mtls=True, grpc_server=request.param)) as running:
        yield running


def test_tritonclient_over_tls_with_client_certificates(mtls_gateway: GatewayThread, pki: Pki) -> None:
    http_tls = {"ssl": True, "ssl_options": {"ca_certs": str(pki.ca), "certfile": str(pki.client_cert),
                                             "keyfile": str(pki.client_key)}}
    assert http_infer(mtls_gateway.hostport, **http_tls) == "2"
    grpc_tls = {"ssl": True, "root_certificates": str(pki.ca), "private_key": str(pki.client_key),
                "certificate_chain": str(pki.client_cert)}
    assert grpc_infer(f"127.0.0.1:{mtls_gateway.settings.grpc_port}", **grpc_tls) == "2"


def test_clients_without_a_certificate_are_refused(mtls_gateway: GatewayThread, pki: Pki) -> None:
    no_certificate = ssl.create_default_context(cafile=pki.ca)
    with pytest.raises(OSError):  # the handshake fails: TLS alert "certificate required"
        urllib.request.urlopen(f"https://{mtls_gateway.hostport}/healthz", context=no_certificate, timeout=5)
    with pytest.raises(OSError):  # plaintext on the TLS port
        urllib.request.urlopen(f"{mtls_gateway.url}/healthz", timeout=5)
    with pytest.raises(InferenceServerException, match="UNAVAILABLE|unavailable"):
        grpc_infer(f"127.0.0.1:{mtls_gateway.settings.grpc_port}", ssl=True, root_certificates=str(pki.ca))
    no_certificate.load_cert_chain(pki.client_cert, pki.client_key)  # the same request, now with one
    with urllib.request.urlopen(f"https://{mtls_gateway.hostport}/healthz", context=no_certificate, timeout=5) as ok:
        assert ok.status == 200


def test_https_and_grpcs_urls_reach_triton_over_tls(triton: LocalTriton, pki: Pki) -> None:
    with GatewayThread(tls_settings(triton, pki, mtls=True)) as tls_front:
        settings = gateway_settings(
            f"https://127.0.0.1:{tls_front.settings.port}", policies={"qc": {"weights": {"3": 100}}},
            triton_grpc_url=f"grpcs://127.0.0.1:{tls_front.settings.grpc_port}", triton_ca_file=pki.ca,
            triton_client_cert_file=pki.client_cert, triton_client_key_file=pki.client_key)
        with GatewayThread(settings) as gateway:
            with urllib.request.urlopen(f"{gateway.url}/readyz", timeout=5) as ready:
                assert ready.status == 200
            assert http_infer(gateway.hostport) == "3"
            assert grpc_infer(f"127.0.0.1:{gateway.settings.grpc_port}") == "3"


def test_tls_settings_that_cannot_work_fail_at_start(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="tls_cert_file and tls_key_file go together"):
        Settings.load(None, tls_cert_file=pki.server_cert)
    with pytest.raises(SettingsError, match="tls_client_ca_file .* needs TLS"):
        Settings.load(None, tls_client_ca_file=pki.ca)
    with pytest.raises(SettingsError, match="tls_key_file"):
        Settings.load(None, tls_cert_file=pki.server_cert, tls_key_file=tmp_path / "missing.key")
    assert Settings.load(None, triton_url="https://triton:8000", triton_grpc_url="grpcs://triton:8001")


def test_a_client_that_never_finishes_the_tls_handshake_is_let_go_after_the_preface_timeout(
        triton: LocalTriton, pki: Pki) -> None:
    """A TCP connection to the TLS gRPC port that sends nothing: asyncio's own handshake timeout
    is 60 s, so 1,000 such sockets would hold the port's file descriptors for a minute each. The
    handshake now counts against grpc_preface_timeout_s (1 s here)."""
    with GatewayThread(tls_settings(triton, pki, mtls=False, grpc_preface_timeout_s=1.0)) as gateway:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", gateway.settings.grpc_port), timeout=10) as silent:
            try:
                closed = silent.recv(1) == b""
            except ConnectionResetError:
                closed = True
        waited = time.monotonic() - started
    assert closed and waited < 5, f"still open after {waited:.1f} s"
