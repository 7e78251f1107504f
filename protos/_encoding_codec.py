"""The compression fields of the Fleet protocol (docs/compression.md), for
`fedloom.protos.codec`: a codec's `Encoding` (and its zstd stage), a Join's codec
requests, and the check that an encoded task's payload is the model encoded with its
codec. In the domain types the zstd stage of a header is its payload's ``wire_bytes``
(not 0: compressed); on the wire ``Encoding.zstd`` says it too, and the two must agree.

Like every ``_from_proto`` of the codec, these treat their input as hostile and raise
`MessageRejectedError` (reason INVALID) saying what was wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from fedloom.compression import CODECS, CodecSpec, CompressionError, encoded_layout
from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.messages import JoinReply
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


def encoding_to_proto(spec: CodecSpec | None, zstd: bool = False) -> ProtoEncoding:
    if spec is None:
        return ProtoEncoding(zstd=zstd)
    return ProtoEncoding(codec=spec.name, block=spec.block, fraction=spec.fraction, zstd=zstd)


def encoding_from_proto(encoding: ProtoEncoding, what: str) -> tuple[CodecSpec | None, bool]:
    """The codec ``encoding`` names (None: no codec) and whether the zstd stage follows;
    INVALID for an unknown codec, bad settings, or neither a codec nor the stage."""
    name, zstd = encoding.codec, bool(encoding.zstd)
    if not name:
        if not zstd:
            raise _invalid(f"{what} names no codec and no zstd stage (leave it unset)")
        if encoding.block or encoding.fraction:
            raise _invalid(f"{what} has codec settings but no codec")
        return None, True
    if name not in CODECS:
        raise _invalid(f"{what} names codec {name[:32]!r}; known: {', '.join(CODECS)}")
    try:
        return CodecSpec(name, int(encoding.block), float(encoding.fraction)), zstd
    except CompressionError as exc:
        raise _invalid(f"{what}: {exc}") from exc


def optional_encoding(message: object, field: str, what: str) -> tuple[CodecSpec | None, bool]:
    """``message.field`` as (codec, zstd), or (None, False) when the field is unset."""
    if not message.HasField(field):  # type: ignore[attr-defined]
        return None, False
    return encoding_from_proto(getattr(message, field), what)


def header_encoding(codec: CodecSpec | None, payload: PayloadInfo | None
                    ) -> ProtoEncoding | None:
    """The `Encoding` of a task or result header: its codec, and the zstd stage when
    its payload travels compressed (None: a plain payload, no field)."""
    zstd = payload is not None and payload.wire_bytes > 0
    if codec is None and not zstd:
        return None
    return encoding_to_proto(codec, zstd)


def _check_stage(zstd: bool, payload: PayloadInfo | None, what: str) -> None:
    if zstd != (payload is not None and payload.wire_bytes > 0):
        raise _invalid(f"{what}: wire_bytes is set exactly when the encoding names the zstd "
                       "stage")


def asked_codecs(names: Iterable[str], what: str) -> tuple[str, ...]:
    """A Join's codec names, kept as sent (unknown names are the server's to skip)."""
    asked = tuple(names)
    if len(asked) > MAX_ASKED:
        raise _invalid(f"{what}: at most {MAX_ASKED} codecs may be asked for")
    for name in asked:
        if len(name) > 32 or not name.isprintable():
            raise _invalid(f"{what}: a codec name is too long or holds control characters")
    return asked


def grants_to_proto(reply: JoinReply, response: ProtoJoinResponse) -> None:
    """Set a Join reply's granted codecs and stages (left unset: none granted)."""
    if reply.upload_codec is not None or reply.upload_zstd:
        response.upload_encoding.CopyFrom(encoding_to_proto(reply.upload_codec,
                                                            reply.upload_zstd))
    if reply.download_codec is not None or reply.download_zstd:
        response.download_encoding.CopyFrom(encoding_to_proto(reply.download_codec,
                                                              reply.download_zstd))


def grants_from_proto(response: ProtoJoinResponse) -> dict[str, Any]:
    """A Join reply's grants, as `JoinReply`'s fields."""
    upload, upload_zstd = optional_encoding(response, "upload_encoding", "the upload grant")
    download, download_zstd = optional_encoding(response, "download_encoding",
                                                "the download grant")
    return {"upload_codec": upload, "upload_zstd": upload_zstd,
            "download_codec": download, "download_zstd": download_zstd}


def task_encoding(header: ProtoTaskHeader, secure: bool, weights: PayloadInfo,
                  parse_spec: Callable[[ProtoTensorSpec], TensorSpec], max_tensors: int
                  ) -> tuple[CodecSpec | None, tuple[TensorSpec, ...]]:
    """A task's codec and decoded layout (None and () for a plain task), checked against
    its payload (`check_encoded_task`). A secure stage is never encoded (its setup binds
    the bytes every participant receives)."""
    if len(header.decoded_tensors) > max_tensors:
        raise _invalid(f"{len(header.decoded_tensors)} decoded tensors; at most {max_tensors}")
    encoding, zstd = optional_encoding(header, "encoding", "the task's weights")
    decoded = tuple(parse_spec(s) for s in header.decoded_tensors)
    if secure and header.HasField("encoding"):
        raise _invalid("a secure-aggregation stage carries the model unencoded")
    _check_stage(zstd, weights, "the task's weights")
    if encoding is None:
        if decoded:
            raise _invalid("decoded_tensors belong to an encoded task (no encoding is set, or it "
                           "names no codec)")
        return None, ()
    check_encoded_task(encoding, decoded, weights)
    return encoding, decoded


def result_encoding(header: ProtoResultHeader, kind: Any, update: PayloadInfo | None
                    ) -> CodecSpec | None:
    """A result's codec (None: plain); only a fit result's update may be encoded (or
    compressed), and its ``wire_bytes`` must agree with the encoding's zstd stage."""
    encoding, zstd = optional_encoding(header, "encoding", "the update")
    if header.HasField("encoding") and kind != "fit":
        raise _invalid("only a fit result's update may be encoded")
    _check_stage(zstd, update, "the update")
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
