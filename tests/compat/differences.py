"""The one list of how the gateway's answers may differ from Triton's own (issue 24 item 8).

The compatibility suite (``tests/compat``) sends each call both to Triton and through the
gateway and compares status, body and metadata after taking out exactly these; anything
else that differs fails it. docs/differences.md carries the same list
(``test_the_docs_list_the_same_differences`` keeps the two equal).
"""

from __future__ import annotations

# (name, what differs): docs/differences.md shows these rows as they are.
DOCUMENTED_DIFFERENCES: tuple[tuple[str, str], ...] = (
    ("ports", "the gateway listens on 8080 (HTTP: `port`) and 8081 (gRPC: `grpc_port`), where Triton listens on "
     "8000 and 8001; its Prometheus metrics are the gateway's own, on 8080 at `/metrics` (Triton's, on 8002, "
     "stay Triton's)"),
    ("routing headers", "inference answers carry `x-gateway-route` and, when the version is known, "
     "`x-gateway-model-version` (unless `expose_version_headers: false`): as HTTP headers, and on gRPC as initial "
     "metadata of an answer with a message, but as trailing metadata of an error answered before any message "
     "(gRPC's trailers-only answer has no initial metadata)"),
    ("request timeout", "an upstream request that has no answer within `request_timeout_s` (60 s) is answered "
     "504 / `DEADLINE_EXCEEDED` by the gateway, even where Triton would have answered at 62 s; a gRPC call's "
     "own deadline replaces it (sent on to Triton no shorter than 1 s, the shorter ones enforced by the "
     "gateway); streams (`ModelStreamInfer`, `generate_stream`) get none"),
    ("message and body sizes", "an HTTP body over `max_body_bytes` (64 MiB, Triton's own default) is 413; a gRPC "
     "message over `grpc_max_message_bytes` (64 MiB) is `RESOURCE_EXHAUSTED` naming the setting (Triton's "
     "own gRPC port takes a 70 MiB tensor); a URL over `max_url_bytes` (4,000 bytes) is 414; "
     "header lines past `max_header_bytes` (64 KiB) or `max_header_count` (100) are 431"),
    ("admission", "past `max_inflight_per_server` (64) requests in flight on a Triton server, a request waits at "
     "the gateway, in order, until its own deadline (`request_timeout_s`, or the gRPC call's) and is then answered "
     "429 with `Retry-After` / `RESOURCE_EXHAUSTED`, where Triton would have kept it queued; with a "
     "`queue_timeout_ms` (unset by default) it waits at most that long; one client address holds at most "
     "`max_connections_per_client` (4,096) connections on a port"),
    ("model control on the data ports", "load/unload, shared-memory (un)registration and trace/log setting "
     "updates are refused (403 / PERMISSION_DENIED) under `triton_control: deny` (the default), need the admin "
     "token under `admin` (401 without it; the gateway takes it out before forwarding), and pass under "
     "`allow`: `perf_analyzer --shared-memory system|cuda` fails at its registration (and shared memory "
     "cannot work across hosts anyway); use the admin API to load and unload"),
    ("the gateway's own answers", "requests the gateway refuses itself (the limits above, connections, "
     "malformed heads, its timeouts) are answered in Triton's `{\"error\": ...}` shape (gRPC: the status's "
     "message), starting `gateway: `, before Triton sees them (see the configuration reference)"),
    ("paths outside /v2", "the gateway's own: `/admin`, `/console`, `/metrics`, `/healthz`, `/readyz`; any other "
     "answers 404 `{\"error\": \"Not Found\"}` as JSON (Triton's says `text/plain`)"),
    ("renamed targets", "a policy may send a model's requests to another model's name (`qc` -> `qc_2026_12`): the "
     "answer, its errors and streams, and the model's metadata, config and ready (answered for the policy's stable "
     "target) say the name the client called; `x-gateway-model-version` names the target that answered"),
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
