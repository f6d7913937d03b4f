"""gRPC on the wire: message framing and status trailers, and the routing fields of a ModelInferRequest.

Framing (:func:`grpc_frame`, :func:`split_messages`, :func:`status_block`) is gRPC over HTTP/2,
kept here so that ``gateway.http2`` stays plain RFC 9113 + HPACK.

Just enough of the protobuf wire format to route a ``ModelInferRequest`` without decoding it.
A ModelInferRequest carries its tensors in ``raw_input_contents`` (field 7); decoding and
re-encoding it per request would copy every tensor twice. Routing needs only
``model_name`` (1), ``model_version`` (2) and, for sequences, three entries of
``parameters`` (4). :func:`route_fields` walks the top-level fields, skipping the others by
their length, and :func:`with_version` appends a new field 2: proto3 says the last value on
the wire wins, so the tensors are forwarded as the client sent them. A call the gateway does
not route (``ModelMetadata`` & co.) is read even less: :func:`message_model_version` takes its
first two fields for the fleet's choice of server, once, by the front.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from gateway.http2.hpack_codec import literal

_OK_TRAILER = literal(b"grpc-status", b"0")
_SEQUENCE_KEYS = (b"sequence_id", b"sequence_start", b"sequence_end")


class WireError(ValueError):
    """Bytes that are not a valid protobuf message."""


@dataclass(frozen=True, slots=True)
class RouteFields:
    model_name: str
    model_version: str
    sequence_id: int | str | None = None  # None: not part of a sequence (0 and "" mean none too)
    sequence_start: bool = False
    sequence_end: bool = False


def _varint(data: Raw, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise WireError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("varint too long")


def _fields(data: Raw, start: int = 0, end: int | None = None):  # type: ignore[no-untyped-def]
    """Yield (field number, wire type, value-or-(start, end) span) for each field."""
    pos, end = start, len(data) if end is None else end
    while pos < end:
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            yield number, wire, value
        elif wire == 2:
            length, pos = _varint(data, pos)
            if pos + length > end:
                raise WireError("length-delimited field runs past the end")
            yield number, wire, (pos, pos + length)
            pos += length
        elif wire == 1:
            pos += 8
            yield number, wire, None
        elif wire == 5:
            pos += 4
            yield number, wire, None
        else:
            raise WireError(f"unsupported wire type {wire}")
    if pos != end:
        raise WireError("message ends inside a field")


# The routing walk is Python on the event loop, a few hundred ns per field: a message of 64 MiB
# written as two-byte fields would hold the loop for seconds. A ModelInferRequest has a handful
# of fields plus about two per tensor (its input or output entry and its raw contents).
MAX_ROUTED_FIELDS = 8192


def route_fields(raw: Raw, with_sequence: bool = True) -> RouteFields:
    """The routing fields; WireError for bytes that are not a ModelInferRequest, including one of
    more than MAX_ROUTED_FIELDS top-level fields."""
    name: bytes | bytearray = b""  # a slice of raw
    version: bytes | bytearray = b""
    sequence: dict[bytes, object] = {}
    for count, (number, wire, value) in enumerate(_fields(raw)):
        if count >= MAX_ROUTED_FIELDS:
            raise WireError(f"more than {MAX_ROUTED_FIELDS} fields: not a request the gateway routes")
        if wire != 2:
            continue
        start, stop = value
        if number == 1:
            name = raw[start:stop]
        elif number == 2:
            version = raw[start:stop]
        elif number == 4 and with_sequence:
            _parameter(raw, start, stop, sequence)
    sequence_id = sequence.get(b"sequence_id")
    return RouteFields(
        model_name=name.decode(errors="replace"),
        model_version=version.decode(errors="replace"),
        sequence_id=sequence_id if sequence_id not in (None, 0, "") else None,  # type: ignore[arg-type]
        sequence_start=bool(sequence.get(b"sequence_start")),
        sequence_end=bool(sequence.get(b"sequence_end")),
    )


def _parameter(raw: Raw, start: int, stop: int, out: dict[bytes, object]) -> None:
    """One map<string, InferParameter> entry: key = 1, value = 2."""
    key = b""
    value_span = None
    for number, wire, value in _fields(raw, start, stop):
        if number == 1 and wire == 2:
            key = bytes(raw[value[0]:value[1]])  # a dict key (raw may be a bytearray)
        elif number == 2 and wire == 2:
            value_span = value
    if key not in _SEQUENCE_KEYS or value_span is None:
        return
    for number, wire, value in _fields(raw, *value_span):
        if number == 1 and wire == 0:  # bool_param
            out[key] = bool(value)
        elif number == 2 and wire == 0:  # int64_param
            out[key] = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 3 and wire == 2:  # string_param
            out[key] = raw[value[0]:value[1]].decode(errors="replace")


_FINAL = b"triton_final_response"


@dataclass(frozen=True, slots=True)
class StreamReply:
    """What a ModelStreamInferResponse says about the request it answers: Triton's error message
    (field 1; empty on success), the model (infer_response.model_name) and whether it is the
    request's last reply (``triton_final_response``; a decoupled model's replies before its
    last say false; without the parameter a reply is the only one)."""

    error: bytes
    model: bytes
    final: bool


def stream_reply(raw: bytes) -> StreamReply:
    """Read, never decode: the tensors are skipped by their length."""
    error, span = b"", None
    for number, wire, value in _fields(raw):
        if wire == 2 and number == 1:
            error = raw[value[0]:value[1]]
        elif wire == 2 and number == 2:
            span = value
    model, final = b"", True
    if span is not None:
        for number, wire, value in _fields(raw, *span):
            if wire != 2:
                continue
            if number == 1:
                model = raw[value[0]:value[1]]
            elif number == 4 and raw.find(_FINAL, value[0], value[1]) >= 0:
                final = _bool_parameter(raw, value, _FINAL, final)
    return StreamReply(error, model, final)


def _bool_parameter(raw: bytes, span: tuple[int, int], key: bytes, default: bool) -> bool:
    """The bool_param of one map<string, InferParameter> entry when its key is ``key``."""
    name, value_span = b"", None
    for number, wire, value in _fields(raw, *span):
        if number == 1 and wire == 2:
            name = raw[value[0]:value[1]]
        elif number == 2 and wire == 2:
            value_span = value
    if name != key or value_span is None:
        return default
    for number, wire, value in _fields(raw, *value_span):
        if number == 1 and wire == 0:
            return bool(value)
    return default


def top_level_field(raw: bytes, number: int) -> bytes | None:
    """The last length-delimited value of top-level field ``number`` (proto3: the last one wins), or None."""
    found = None
    for field, wire, value in _fields(raw):
        if field == number and wire == 2:
            found = value
    return None if found is None else raw[found[0]:found[1]]


def message_model_version(message: Raw) -> tuple[bytes, bytes | None]:
    """Fields 1 and 2 (model name and version) of a ModelInferRequest, ModelMetadataRequest and
    the like: what a fleet picks a server by, for a call the router does not route.

    The last occurrence wins, as in protobuf. Only field headers are read; every field of these
    messages is length-delimited, so the scan skips what it does not need without touching it
    and never raises: (b"", None) if absent, what was read before anything it cannot follow.
    """
    model = version = b""
    pos, size = 0, len(message)
    while pos < size:
        tag = message[pos]
        if tag & 7 != 2 or tag > 0x7F:
            break  # not a field these messages have: keep what was read
        length = message[pos + 1] if pos + 1 < size else 0
        if length < 0x80:
            pos += 2
        else:
            length, pos = _varint_or_end(message, pos + 1)
        end = pos + length
        if tag == 0x0A:
            model = bytes(message[pos:end])  # keys of the fleet's cache (message may be a bytearray)
        elif tag == 0x12:
            version = bytes(message[pos:end])
        pos = end
    return model, version or None


def _varint_or_end(data: Raw, pos: int) -> tuple[int, int]:
    """A varint, or what of it there is before the end (never raises: see message_model_version)."""
    value = shift = 0
    while pos < len(data):
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            break
        shift += 7
    return value, pos


def with_version(raw: Raw, version: str) -> bytes:
    """The same message with ``model_version`` set: a trailing field 2 overrides earlier ones."""
    return b"".join((raw, version_field(version)))


def version_field(version: str) -> bytes:
    """Field 2 (``model_version``) on the wire: appended to a message, it overrides the client's."""
    encoded = version.encode()
    return b"\x12" + _encode_varint(len(encoded)) + encoded


# A request message as it arrived: bytes, or (a large one spread over DATA frames) the bytearray it
# was assembled in, never copied again into bytes.
Raw = bytes | bytearray
# A message as it is forwarded: as the client sent it, or (raw, field) with a version field after
# it. The tensors are never copied to append a field: the two go out one after the other.
Message = Raw | tuple[Raw, bytes]


def addressed(raw: Raw, version: str | None, model: str | None = None) -> Message:
    """``raw`` sent to ``version`` (None: the one it names, if any), of ``model`` (None: the one
    it names; a renamed target's, grpc.renamed): fields 1 and 2 appended, the last value wins."""
    tail = b"" if model is None else _length_delimited(0x0A, model.encode())
    if version is not None:
        tail += version_field(version)
    return (raw, tail) if tail else raw


def _length_delimited(tag: int, value: bytes) -> bytes:
    return bytes((tag,)) + _encode_varint(len(value)) + value


def message_size(message: Message) -> int:
    return len(message[0]) + len(message[1]) if isinstance(message, tuple) else len(message)


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


# -- gRPC message framing (length-prefixed messages, status trailers) ------------------------------
def grpc_frame(message: bytes) -> bytes:
    """One gRPC length-prefixed message (uncompressed)."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


def grpc_parts(message: Message) -> tuple[Raw, ...]:
    """One gRPC length-prefixed message (uncompressed) as the parts it is sent in: the prefix,
    then the message's own buffers (never joined into a copy of it)."""
    if not isinstance(message, tuple):
        return b"\x00" + len(message).to_bytes(4, "big"), message
    raw, field = message
    return b"\x00" + (len(raw) + len(field)).to_bytes(4, "big"), raw, field


class MessageTooLarge(ValueError):
    pass


def split_messages(data: bytes | bytearray, limit: int = 1 << 30) -> tuple[list[tuple[bool, bytes]], int]:
    """The whole gRPC messages at the start of ``data`` as (compressed, message), and how many
    bytes they took; a partial one stays for the next DATA frame."""
    messages, pos, size = [], 0, len(data)
    while size - pos >= 5:
        length = int.from_bytes(data[pos + 1:pos + 5], "big")
        if length > limit:
            raise MessageTooLarge(f"message of {length} bytes is above the limit of {limit} bytes")
        if size - pos - 5 < length:
            break
        messages.append((data[pos] != 0, bytes(data[pos + 5:pos + 5 + length])))
        pos += 5 + length
    return messages, pos


def grpc_message(details: str) -> bytes:
    """``grpc-message`` is percent-encoded UTF-8 (printable ASCII other than '%' stays)."""
    raw = details.encode("utf-8", "replace")
    if all(0x20 <= byte <= 0x7E and byte != 0x25 for byte in raw):
        return raw
    return b"".join(bytes([byte]) if 0x20 <= byte <= 0x7E and byte != 0x25 else b"%%%02X" % byte for byte in raw)


def metadata_block(metadata: tuple[tuple[str, str], ...]) -> bytes:
    return b"".join(literal(key.encode(), value.encode()) for key, value in metadata)


def status_block(code: int, details: str) -> bytes:
    if code == 0 and not details:
        return _OK_TRAILER
    block = literal(b"grpc-status", str(code).encode())
    return block + literal(b"grpc-message", grpc_message(details)) if details else block


# -- messages out of the pieces they arrived in (DATA frames, reads) --------------------------------
def peek(pieces: deque[memoryview], count: int) -> bytes:
    """The first ``count`` bytes held in ``pieces`` (at least that many are), left in place."""
    first = pieces[0]
    if len(first) >= count:
        return bytes(first[:count])
    out = bytearray()
    for piece in pieces:
        out += piece[:count - len(out)]
        if len(out) >= count:
            break
    return bytes(out)


def take(pieces: deque[memoryview], count: int) -> bytes:
    """The first ``count`` bytes held in ``pieces`` (at least that many are), taken out of them
    and joined into one ``bytes``: the message's one copy."""
    if not count:
        return b""
    first = pieces[0]
    if len(first) >= count:
        if len(first) == count:
            pieces.popleft()
        else:
            pieces[0] = first[count:]
        return bytes(first[:count])
    parts = []
    while count:
        piece = pieces[0]
        if len(piece) <= count:
            parts.append(pieces.popleft())
            count -= len(piece)
        else:
            parts.append(piece[:count])
            pieces[0] = piece[count:]
            count = 0
    return b"".join(parts)
