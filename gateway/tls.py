"""TLS contexts, built once at start from the settings: the data ports' and the ones to Triton.

- Serving: ``tls_cert_file`` + ``tls_key_file`` turn the HTTP port into HTTPS (uvicorn's own
  context, from the same files) and the gRPC port into gRPC over TLS, ALPN ``h2`` as gRPC
  clients require. ``tls_client_ca_file`` makes both ports ask for a client certificate and
  refuse a handshake without one signed by that CA (mTLS).
- To Triton: ``https://`` and ``grpcs://`` URLs verify Triton's certificate against
  ``triton_ca_file`` (else the system's trust store) and the host name, and present
  ``triton_client_cert_file`` when Triton itself requires mTLS.

TLS 1.2 is the floor on every context (what the RFC 9113 profile requires for h2, and the
default of every current client).
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from gateway.settings import Settings

H2, HTTP11 = ["h2"], ["http/1.1"]


def server_context(cert_file: Path, key_file: Path, client_ca_file: Path | None,
                   alpn: list[str]) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    if client_ca_file is not None:
        context.load_verify_locations(client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(alpn)
    return context


def client_context(ca_file: Path | None, cert_file: Path | None, key_file: Path | None,
                   alpn: list[str]) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_file)  # verifies the chain and the host name
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file)
    context.set_alpn_protocols(alpn)
    return context


def _read(path: Path | None) -> bytes | None:
    """A PEM file's bytes, for grpcio's credentials (which take contents, not paths)."""
    return None if path is None else path.read_bytes()


def serving(settings: Settings, alpn: list[str]) -> ssl.SSLContext | None:
    """The data ports' context, or None when they serve plaintext."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    return server_context(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file, alpn)


def to_triton(settings: Settings, alpn: list[str]) -> ssl.SSLContext:
    return client_context(settings.triton_ca_file, settings.triton_client_cert_file,
                          settings.triton_client_key_file, alpn)


def upstream_http(settings: Settings) -> ssl.SSLContext | None:
    """The context for every https:// Triton server (triton_url or a fleet's); plain servers ignore it."""
    urls = [settings.triton_url, *(server.http for spec in settings.fleet_specs().values()
                                   for server in spec.servers or [])]
    return to_triton(settings, HTTP11) if any(url.startswith("https://") for url in urls) else None


def upstream_grpc(settings: Settings) -> ssl.SSLContext | None:
    """The context for every grpcs:// Triton server (triton_grpc_url or a fleet's)."""
    urls = [settings.triton_grpc_url, *(server.grpc for spec in settings.fleet_specs().values()
                                        for server in spec.servers or [])]
    return to_triton(settings, H2) if any(url.startswith("grpcs://") for url in urls) else None


def grpcio_server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """The same files for grpcio's server (``grpc_server: grpcio``)."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    ca = _read(settings.tls_client_ca_file)
    return grpc.ssl_server_credentials([(settings.tls_key_file.read_bytes(), settings.tls_cert_file.read_bytes())],
                                       root_certificates=ca, require_client_auth=ca is not None)


def grpcio_channel_credentials(settings: Settings) -> grpc.ChannelCredentials | None:
    """For grpcio's channel to Triton (streams behind ``grpc_server: grpcio``)."""
    if not settings.triton_grpc_url.startswith("grpcs://"):
        return None
    return grpc.ssl_channel_credentials(_read(settings.triton_ca_file), _read(settings.triton_client_key_file),
                                        _read(settings.triton_client_cert_file))
