"""gRPC messages of a renamed target: a client that called ``qc`` sees ``qc``, whichever model answered.

The gRPC side of :mod:`gateway.proxy.renamed`; only requests routed to another model's name
come here (one attribute test per request otherwise). Messages stay bytes, as everywhere on
the gRPC path (``grpc.wire``):

- a request goes up with a trailing ``model_name`` (field 1), and ``model_version`` (2) when
  the target names one: proto3 lets the last value on the wire win, so the client's bytes,
  tensors included, are forwarded as they are;
- a ModelInferResponse (and ModelMetadataResponse) carries the model's name in field 1, which
  Triton writes first: that field is written again with the called name and the rest of the
  message follows unread; a ModelConfigResponse has it one level down (``config.name``), a
  ModelStreamInferResponse in ``infer_response`` (field 2) and its ``error_message`` (field 1);
  a ModelReadyResponse names nothing;
- Triton's error texts (status details, a stream's error_message) name a model in single
  quotes: the quoted name says the called one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from gateway.grpc.wire import WireError, _encode_varint, _fields, _varint

_NAME = 1  # model_name / name / config (ModelConfigResponse) / error_message (stream): each field 1
_INFER_RESPONSE = 2  # ModelStreamInferResponse.infer_response


def _field(number: int, value: bytes) -> bytes:
    return _encode_varint(number << 3 | 2) + _encode_varint(len(value)) + value


def with_model(raw: bytes | bytearray, model: str, version: str | None) -> bytes:
    """A request (ModelInfer, ModelMetadata, ModelConfig, ModelReady: fields 1 and 2 alike)
    addressed to ``model`` (at ``version``; None: the version the client sent, if any), in one
    buffer (a copy: a shadow's, or a small call's; ModelInfer itself goes as ``wire.addressed``'s parts)."""
    tail = _field(_NAME, model.encode())
    return b"".join((raw, tail if version is None else tail + _field(2, version.encode())))


@dataclass(frozen=True, slots=True)
class GrpcRename:
    """The replacements for answers of one model that a client asked of another name (:func:`grpc_rename`)."""

    answering: bytes
    called: bytes
    quoted_from: str
    quoted_to: str

    def details(self, text: str) -> str:
        """Triton's status details (or a stream's error) with the called name."""
        return text.replace(self.quoted_from, self.quoted_to) if text else text

    def reply(self, message: bytes) -> bytes:
        """A ModelInferResponse or ModelMetadataResponse: field 1, when it names the answering
        model, says the called name. Triton writes it first: it is rewritten there and the rest
        copied as it is (a message that does not start with it is left alone)."""
        if message[:1] == b"\x0a":
            try:
                length, start = _varint(message, 1)
            except WireError:
                return message
            if message[start:start + length] == self.answering:
                return _field(_NAME, self.called) + message[start + length:]
        return message

    def config_reply(self, message: bytes) -> bytes:
        """A ModelConfigResponse: ``config`` (field 1) is a ModelConfig whose field 1 is the name."""
        return _fields_rewritten(message, {_NAME: self.reply})

    def stream_reply(self, message: bytes) -> bytes:
        """A ModelStreamInferResponse: its infer_response renamed, its error_message's quoted name too."""
        return _fields_rewritten(message, {_INFER_RESPONSE: self.reply, _NAME: self._error})

    def _error(self, text: bytes) -> bytes:
        return self.details(text.decode(errors="surrogateescape")).encode(errors="surrogateescape")


def _fields_rewritten(message: bytes, rewrites: dict[int, Callable[[bytes], bytes]]) -> bytes:
    """``message`` with its top-level fields of these numbers rewritten (all of its fields are
    length-delimited; anything else, or bytes that are not a message, leave it as it is)."""
    try:
        out = []
        for number, wire, span in _fields(message):
            if wire != 2:
                return message
            value = message[span[0]:span[1]]
            rewrite = rewrites.get(number)
            out.append(_field(number, value if rewrite is None else rewrite(value)))
        return b"".join(out)
    except WireError:
        return message


@lru_cache(maxsize=1024)
def grpc_rename(answering: str, called: str) -> GrpcRename:
    return GrpcRename(answering.encode(), called.encode(), f"'{answering}'", f"'{called}'")
