"""Compression on the server's side (docs/compression.md): grants at Join, the encoded
(and zstd-compressed) broadcast a task carries, and the checks an encoded update passes
before it is folded.

An encoded update is refused, and its task fails, when it names a codec the session was
not granted (FAILED_PRECONDITION), when its payload header is not the model's layout
encoded with that codec (INVALID_ARGUMENT: refused before any byte arrives), or when,
whole and verified, it does not decode (an index past its tensor, a code outside the
levels: INVALID_ARGUMENT; checked on the parts, without a decode where they suffice).
A zstd-compressed update is refused when the session was not granted the stage
(FAILED_PRECONDITION, before any byte); its stream is decompressed as it arrives
(`fedloom.server.uploads`), and one that does not decompress to its header's payload
fails its task (INVALID_ARGUMENT). The spooled upload stays encoded on disk (no longer
compressed); the strategy reads it through
`fedloom.compression.DecodedWeights`, one decoded tensor at a time. Every
strategy therefore sees decoded deltas of the model's layout, and whatever clips does so
to the decoded update: an update-norm bound, and central DP's clip to C, which the
privacy guarantee rests on (a client's own clip comes before it encodes, and a codec may
move the norm).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence

from fedloom.compression import (
    CodecSpec,
    CompressionError,
    DecodedWeights,
    check_encoded,
    choose,
    encoded_layout,
    split_stage,
    stage_name,
)
from fedloom.config import CompressionConfig
from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.messages import JoinRequest, ResultHeader
from fedloom.payload import PayloadInfo
from fedloom.server.model import GlobalModel, Grant
from fedloom.server.registry import ClientRecord, ClientRegistry
from fedloom.weights import TensorSpec, Weights, layout_mismatch

log = logging.getLogger("fedloom.server")


class EncodingRefusedError(MessageRejectedError):
    """An encoded update was refused for its encoding: the task that carried it fails."""


@dataclasses.dataclass(frozen=True)
class Grants:
    """The codecs granted to one session (None: plain float32), and whether the zstd
    stage may follow each."""

    upload: CodecSpec | None = None
    download: CodecSpec | None = None
    upload_zstd: bool = False
    download_zstd: bool = False


def grant(config: CompressionConfig, request: JoinRequest, client: str) -> Grants:
    """The first name per direction (a codec, with or without ``+zstd``, or ``zstd``)
    that the client asks for and the server accepts.

    A client asking for nothing (every client before compression existed) is granted
    nothing. One asking only for codecs the server does not accept is granted nothing
    either, not refused: it sends and receives plain float32, and the log says why.
    """
    upload = choose(request.upload_codecs, config.upload)
    download = choose(request.download_codecs, config.download)
    for direction, asked, granted, accepted in (
            ("upload", request.upload_codecs, upload, config.upload),
            ("download", request.download_codecs, download, config.download)):
        if asked and granted is None:
            log.info("client %s asked for %s codecs %s; none granted (compression.%s "
                     "accepts %s): it %s plain float32", client, direction, list(asked),
                     direction, list(accepted) or "none",
                     "uploads" if direction == "upload" else "downloads",
                     extra={"client": client, "direction": direction})
        elif granted is not None:
            log.info("client %s: %s codec %s granted (it asked for %s)", client, direction,
                     granted, list(asked), extra={"client": client, "direction": direction})
    up_codec, up_zstd = split_stage(upload or "")
    down_codec, down_zstd = split_stage(download or "")
    return Grants(config.spec(up_codec) if up_codec else None,
                  config.spec(down_codec) if down_codec else None, up_zstd, down_zstd)


def broadcast(model: GlobalModel, codec: CodecSpec | None, zstd: bool = False
              ) -> tuple[PayloadInfo, memoryview, CodecSpec | None, tuple[TensorSpec, ...]]:
    """What a task to a client granted download ``codec`` (and ``zstd``) carries: the
    payload's header, the payload (the zstd frame, when granted and smaller), and (when
    encoded) the codec and the model's own layout.

    The encoding and the frame are normally built already, in the aggregation thread
    (`GlobalModel.publish` and `GlobalModel.prepare`, for the grants in
    `download_grants`). What is not is built here, on the calling thread, which is the
    event loop: the callers that issue tasks (`fedloom.server.plain_round.issue_phase`,
    the asynchronous driver's top-up) are synchronous, and a task's header must carry
    the payload's digest when it is issued, so there is no await to put the build
    behind. Nothing leaves this fallback work to do: the round loop prepares every held
    grant before a synchronous or secure round's fit and evaluation tasks are issued,
    with no await in between, and the asynchronous driver issues a task only to a
    session whose grant is built (it builds the rest in the executor first).
    """
    info, payload, used = model.current.select(codec, zstd)
    return info, payload, used, model.info.specs if used is not None else ()


def download_grants(registry: ClientRegistry) -> set[Grant]:
    """The download grants the connected sessions hold (each once); read on the loop."""
    return {grant_of(record) for record in registry.records()}


def grant_of(record: ClientRecord | None) -> Grant:
    """A session's download grant (a session gone meanwhile: plain, no zstd)."""
    if record is None:
        return None, False
    return record.download_codec, record.download_zstd


def check_zstd(granted: bool, header: ResultHeader) -> None:
    """Refuse a zstd-compressed update from a session not granted the stage.

    Raises:
        EncodingRefusedError: FAILED_PRECONDITION.
    """
    if header.update is not None and header.update.wire_bytes and not granted:
        used = stage_name(header.codec.name if header.codec else "", True)
        raise EncodingRefusedError(
            RejectReason.STALE,
            f"the update is zstd-compressed ({used}), but this session was not granted the "
            "zstd stage at Join; send it uncompressed, or join again asking for it")


def check_encoding(granted: CodecSpec | None, header: ResultHeader,
                   model: Sequence[TensorSpec]) -> None:
    """Refuse a fit result whose encoding the session was not granted, or whose payload
    header is not ``model`` encoded with its codec (before any byte arrives).

    A plain update (no codec) is always allowed: a granted codec is a permission, not a
    duty (a client may send plain what its codec cannot carry).

    Raises:
        EncodingRefusedError: FAILED_PRECONDITION (a codec not granted) or INVALID (a
            payload of another layout).
    """
    codec = header.codec
    if codec is None:
        return
    assert header.update is not None  # a fit result carries one (checked by the codec)
    if codec != granted:
        held = f"it was granted {granted}" if granted is not None else "it was granted none"
        raise EncodingRefusedError(
            RejectReason.STALE,
            f"the update is encoded with {codec}, which this session was not granted "
            f"({held}, at Join); send it plain or with the granted codec, or join again")
    try:
        expected = encoded_layout(codec.build(), model)
    except CompressionError as exc:
        raise EncodingRefusedError(RejectReason.INVALID, f"the model cannot be encoded with "
                                   f"{codec}: {exc}") from exc
    problem = layout_mismatch(expected, header.update.specs)
    if problem:
        raise EncodingRefusedError(
            RejectReason.INVALID,
            f"the update is not the model's layout encoded with {codec}: {problem}")


def decoded(codec: CodecSpec | None, model: Sequence[TensorSpec], payload: Weights) -> Weights:
    """The update a strategy reads: ``payload`` itself, or its tensors decoded one per
    access (`DecodedWeights`; nothing decoded is kept)."""
    if codec is None:
        return payload
    return DecodedWeights(codec.build(), model, payload)


async def check_decodes(codec: CodecSpec | None, model: Sequence[TensorSpec],
                        payload: Weights) -> Weights:
    """The decoded view of a whole, verified upload, once its parts are known to decode
    to finite values (`fedloom.compression.check_encoded`, off the event loop, without
    decoding what the parts alone vouch for); `EncodingRefusedError` (INVALID) for parts
    no honest encoder produces.

    Checked before the update is folded or acknowledged, so that a hostile payload fails
    its own task rather than the round's aggregation.
    """
    update = decoded(codec, model, payload)
    if codec is None:
        return update
    try:
        await asyncio.to_thread(check_encoded, codec.build(), model, payload)
    except CompressionError as exc:
        raise EncodingRefusedError(RejectReason.INVALID,
                                   f"the update does not decode with {codec}: {exc}") from exc
    return update
