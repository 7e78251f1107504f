"""The compression fields of the Fleet protocol (docs/compression.md), for
`fedloom.protos.codec`: a codec's `Encoding`, a Join's codec requests, and the check that
an encoded task's payload is the model encoded with its codec.

Like every ``_from_proto`` of the codec, these treat their input as hostile and raise
`MessageRejectedError` (reason INVALID) saying what was wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from fedloom.compression import CODECS, CodecSpec, CompressionError, encoded_layout
from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.payload import PayloadInfo
from fedloom.protos.fedloom.v1.fleet_pb2 import Encoding as ProtoEncoding
from fedloom.protos.fedloom.v1.fleet_pb2 import JoinResponse as ProtoJoinResponse
from fedloom.protos.fedloom.v1.fleet_pb2 import ResultHeader as ProtoResultHeader
from fedloom.protos.fedloom.v1.fleet_pb2 import TaskHeader as ProtoTaskHeader
from fedloom.protos.fedloom.v1.fleet_pb2 import TensorSpec as ProtoTensorSpec
from fedloom.weights import TensorSpec, layout_mismatch

#: Codec names one Join may ask for, per direction.
MAX_ASKED = 8


def _invalid(message: str) -> MessageRejectedError:
    return MessageRejectedError(RejectReason.INVALID, message)


def encoding_to_proto(spec: CodecSpec) -> ProtoEncoding:
    return ProtoEncoding(codec=spec.name, block=spec.block, fraction=spec.fraction)


def encoding_from_proto(encoding: ProtoEncoding, what: str) -> CodecSpec:
    """The codec ``encoding`` names; INVALID for an unknown one or bad settings."""
    name = encoding.codec
    if name not in CODECS:
        raise _invalid(f"{what} names codec {name[:32]!r}; known: {', '.join(CODECS)}")
    try:
        return CodecSpec(name, int(encoding.block), float(encoding.fraction))
    except CompressionError as exc:
        raise _invalid(f"{what}: {exc}") from exc


def optional_encoding(message: object, field: str, what: str) -> CodecSpec | None:
    """``message.field`` as a `CodecSpec`, or None when the field is unset."""
    if not message.HasField(field):  # type: ignore[attr-defined]
        return None
    return encoding_from_proto(getattr(message, field), what)


def asked_codecs(names: Iterable[str], what: str) -> tuple[str, ...]:
    """A Join's codec names, kept as sent (unknown names are the server's to skip)."""
    asked = tuple(names)
    if len(asked) > MAX_ASKED:
        raise _invalid(f"{what}: at most {MAX_ASKED} codecs may be asked for")
    for name in asked:
        if len(name) > 32 or not name.isprintable():
            raise _invalid(f"{what}: a codec name is too long or holds control characters")
    return asked


def grants_to_proto(upload: CodecSpec | None, download: CodecSpec | None,
                    response: ProtoJoinResponse) -> None:
    """Set a Join reply's granted codecs (left unset: none granted)."""
    if upload is not None:
        response.upload_encoding.CopyFrom(encoding_to_proto(upload))
    if download is not None:
        response.download_encoding.CopyFrom(encoding_to_proto(download))


def task_encoding(header: ProtoTaskHeader, secure: bool, weights: PayloadInfo,
                  parse_spec: Callable[[ProtoTensorSpec], TensorSpec], max_tensors: int
                  ) -> tuple[CodecSpec | None, tuple[TensorSpec, ...]]:
    """A task's codec and decoded layout (None and () for a plain task), checked against
    its payload (`check_encoded_task`). A secure stage is never encoded (its setup binds
    the bytes every participant receives)."""
    if len(header.decoded_tensors) > max_tensors:
        raise _invalid(f"{len(header.decoded_tensors)} decoded tensors; at most {max_tensors}")
    encoding = optional_encoding(header, "encoding", "the task's weights")
    decoded = tuple(parse_spec(s) for s in header.decoded_tensors)
    if encoding is None:
        if decoded:
            raise _invalid("decoded_tensors belong to an encoded task (no encoding is set)")
        return None, ()
    if secure:
        raise _invalid("a secure-aggregation stage carries the model unencoded")
    check_encoded_task(encoding, decoded, weights)
    return encoding, decoded


def result_encoding(header: ProtoResultHeader, kind: Any) -> CodecSpec | None:
    """A result's codec (None: plain); only a fit result's update may be encoded."""
    encoding = optional_encoding(header, "encoding", "the update")
    if encoding is not None and kind != "fit":
        raise _invalid("only a fit result's update may be encoded")
    return encoding


def check_encoded_task(codec: CodecSpec, decoded: Sequence[TensorSpec],
                       weights: PayloadInfo) -> None:
    """An encoded task's payload must be its model (``decoded``) encoded with ``codec``."""
    if not decoded:
        raise _invalid("an encoded task must name the layout its weights decode into")
    if len({s.name for s in decoded}) != len(decoded):
        raise _invalid("a tensor name appears twice in the task's decoded layout")
    try:
        expected = encoded_layout(codec.build(), decoded)
    except CompressionError as exc:
        raise _invalid(f"the task's decoded layout cannot be encoded with {codec}: {exc}") from exc
    problem = layout_mismatch(expected, weights.specs)
    if problem:
        raise _invalid(f"the task's weights are not its model encoded with {codec}: {problem}")
