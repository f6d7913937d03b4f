"""The one list of how the gateway's answers may differ from Triton's own (issue 24 item 8).

The compatibility suite (``tests/compat``) sends each call both to Triton and through the
gateway and compares status, body and metadata after taking out exactly these; anything
else that differs fails it. docs/differences.md carries the same list
(``test_the_docs_list_the_same_differences`` keeps the two equal).
"""

from __future__ import annotations

# (name, what differs): docs/differences.md shows these rows as they are.
DOCUMENTED_DIFFERENCES: tuple[tuple[str, str], ...] = (
    ("routing headers", "inference answers (HTTP headers, gRPC initial metadata) carry `x-gateway-route` and, "
     "when the version is known, `x-gateway-model-version` (unless `expose_version_headers: false`)"),
    ("model control on the data ports", "load/unload, shared-memory (un)registration and trace/log setting "
     "updates are refused (403 / PERMISSION_DENIED) under `triton_control: deny` (the default), need the admin "
     "token under `admin` (401 without it; the gateway takes it out before forwarding), and pass under `allow`"),
    ("the gateway's own limits", "requests past the gateway's limits (body, header and URL sizes, connections, "
     "admission, its own timeouts) are answered by the gateway in Triton's `{\"error\": ...}` shape "
     "(see the configuration reference), before Triton sees them"),
    ("paths outside /v2", "the gateway's own: `/admin`, `/console`, `/metrics`, `/healthz`, `/readyz`; any other "
     "answers 404 `{\"error\": \"Not Found\"}` as JSON (Triton's says `text/plain`)"),
    ("HTTP header details", "the gateway's HTTP answers carry a `date` header (Triton's carry none), write header "
     "names in lower case (HTTP header names are case-insensitive), and may frame a body that Triton sends "
     "`chunked` with a `content-length` (e.g. generate), or the other way round: the body's bytes are the same"),
    ("Transfer-Encoding with Content-Length", "a request carrying both is read by its chunked body, as Triton "
     "reads it, with its `Content-Length` dropped before forwarding; the gateway closes the connection after "
     "answering it (RFC 9112 6.3), where Triton keeps it open and checks the body against that `Content-Length`"),
)

ROUTING_HEADERS = frozenset(["x-gateway-model-version", "x-gateway-route"])
# HTTP headers not compared: those the gateway adds, and framing (every other header must be Triton's).
# (framing: transfer-encoding and content-length are not compared; the bodies are, byte for byte)
UNCOMPARED_HEADERS = frozenset(["date", "transfer-encoding", "content-length"]) | ROUTING_HEADERS
