"""The one codec between fedloom's domain types and the Fleet protocol's protobuf.

Functions come in ``x_to_proto`` / ``x_from_proto`` pairs. Every ``_from_proto``
treats its input as hostile: it checks sizes, names, dtypes, shapes and ranges and
raises `MessageRejectedError` (reason INVALID) with a message that says what was wrong.
Generated classes are imported under a ``Proto`` prefix so wire and domain names never
collide. The secure-aggregation stage messages are converted by
`fedloom.protos._secagg_codec` (their parts by `fedloom.protos._secagg_parts`), and the
compression fields by `fedloom.protos._encoding_codec`, which the pairs here call;
chunks travel as hand-serialized frames (`fedloom.protos._frames`, re-exported here).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from fedloom._text import one_line
from fedloom.errors import ConfigError, MessageRejectedError, RejectReason
from fedloom.messages import JoinReply, JoinRequest, NoTask, ResultHeader, Session, TaskHeader
from fedloom.payload import PayloadInfo
from fedloom.protos._encoding_codec import (
    asked_codecs,
    grants_from_proto,
    grants_to_proto,
    header_encoding,
    result_encoding,
    task_encoding,
)
from fedloom.protos._frames import chunk_frame as chunk_frame
from fedloom.protos._frames import serialize_message as serialize_message
from fedloom.protos._secagg_codec import (
    secagg_result_from_proto,
    secagg_result_to_proto,
    secagg_task_from_proto,
    secagg_task_to_proto,
)
from fedloom.protos.fedloom.v1.fleet_pb2 import Chunk as ProtoChunk
from fedloom.protos.fedloom.v1.fleet_pb2 import EvaluateResult as ProtoEvaluateResult
from fedloom.protos.fedloom.v1.fleet_pb2 import EvaluateTask as ProtoEvaluateTask
from fedloom.protos.fedloom.v1.fleet_pb2 import FitResult as ProtoFitResult
from fedloom.protos.fedloom.v1.fleet_pb2 import FitTask as ProtoFitTask
from fedloom.protos.fedloom.v1.fleet_pb2 import JoinRequest as ProtoJoinRequest
from fedloom.protos.fedloom.v1.fleet_pb2 import JoinResponse as ProtoJoinResponse
from fedloom.protos.fedloom.v1.fleet_pb2 import NoTask as ProtoNoTask
from fedloom.protos.fedloom.v1.fleet_pb2 import PayloadHeader as ProtoPayloadHeader
from fedloom.protos.fedloom.v1.fleet_pb2 import PullResponse as ProtoPullResponse
from fedloom.protos.fedloom.v1.fleet_pb2 import PushRequest as ProtoPushRequest
from fedloom.protos.fedloom.v1.fleet_pb2 import Record as ProtoRecord
from fedloom.protos.fedloom.v1.fleet_pb2 import ResultHeader as ProtoResultHeader
from fedloom.protos.fedloom.v1.fleet_pb2 import Session as ProtoSession
from fedloom.protos.fedloom.v1.fleet_pb2 import TaskFailure as ProtoTaskFailure
from fedloom.protos.fedloom.v1.fleet_pb2 import TaskHeader as ProtoTaskHeader
from fedloom.protos.fedloom.v1.fleet_pb2 import TensorSpec as ProtoTensorSpec
from fedloom.protos.fedloom.v1.fleet_pb2 import Value as ProtoValue
from fedloom.types import Scalar, TaskKind, validate_record
from fedloom.weights import MAX_NDIM, TensorSpec

MAX_TENSORS = 100_000
MAX_ID_LENGTH = 128
MAX_CAPABILITIES = 64
MAX_TEXT = 4096
#: The shortest heartbeat interval and long poll a join reply may set (a server setting
#: of less would make its clients call it in a tight loop), and the smallest chunk.
MIN_INTERVAL_S = 0.1
MIN_CHUNK_BYTES = 1024
MAX_DIM = 1 << 40
#: One tensor's bytes at most: beyond any max_model_bytes, and far from int64's range.
MAX_TENSOR_BYTES = 1 << 40


def _invalid(message: str) -> MessageRejectedError:
    return MessageRejectedError(RejectReason.INVALID, message)


def _check_text(
    value: str, what: str, limit: int = MAX_ID_LENGTH, *, printable: bool = True
) -> str:
    if len(value) > limit:
        raise _invalid(f"{what} is {len(value)} characters; at most {limit} allowed")
    if printable and not value.isprintable():  # ids and names end up in logs
        raise _invalid(f"{what} holds control characters (newlines, NUL, ...)")
    return value


# ---- values and records ---------------------------------------------------------
def value_to_proto(value: Scalar) -> ProtoValue:
    if isinstance(value, bool):
        return ProtoValue(bool_value=value)
    if isinstance(value, int):
        return ProtoValue(int_value=value)
    if isinstance(value, float):
        return ProtoValue(float_value=value)
    if isinstance(value, str):
        return ProtoValue(string_value=value)
    if isinstance(value, bytes):
        return ProtoValue(bytes_value=value)
    raise TypeError(f"{type(value).__name__} cannot travel in a record")


def value_from_proto(value: ProtoValue) -> Scalar:
    kind = value.WhichOneof("kind")
    if kind is None:
        raise _invalid("a record value has no kind set")
    result: Scalar = getattr(value, kind)
    return result


def record_to_proto(record: Mapping[str, Scalar]) -> ProtoRecord:
    out = ProtoRecord()
    for key, value in record.items():
        out.entries[key].CopyFrom(value_to_proto(value))
    return out


def record_from_proto(record: ProtoRecord, what: str) -> dict[str, Scalar]:
    raw = {key: value_from_proto(value) for key, value in record.entries.items()}
    try:
        return dict(validate_record(raw, what))
    except ValueError as exc:
        raise _invalid(str(exc)) from exc


# ---- tensors and payloads -------------------------------------------------------
def spec_to_proto(spec: TensorSpec) -> ProtoTensorSpec:
    return ProtoTensorSpec(name=spec.name, dtype=spec.dtype, shape=list(spec.shape))


def spec_from_proto(spec: ProtoTensorSpec) -> TensorSpec:
    if len(spec.shape) > MAX_NDIM or any(d > MAX_DIM for d in spec.shape):
        raise _invalid(f"tensor {spec.name[:64]!r} has an absurd shape")
    try:
        result = TensorSpec(spec.name, spec.dtype, tuple(int(d) for d in spec.shape))
    except ConfigError as exc:
        raise _invalid(str(exc)) from exc
    # Count in Python ints: numpy's int64 product of hostile dims wraps (2**40 * 2**40 == 0).
    if math.prod(result.shape) * result.numpy_dtype.itemsize > MAX_TENSOR_BYTES:
        raise _invalid(f"tensor {result.name[:64]!r} would exceed {MAX_TENSOR_BYTES} bytes")
    return result


def payload_to_proto(info: PayloadInfo) -> ProtoPayloadHeader:
    return ProtoPayloadHeader(
        tensors=[spec_to_proto(s) for s in info.specs],
        total_bytes=info.total_bytes,
        sha256=info.sha256,
        wire_bytes=info.wire_bytes,
    )


def payload_from_proto(header: ProtoPayloadHeader) -> PayloadInfo:
    if len(header.tensors) > MAX_TENSORS:
        raise _invalid(f"{len(header.tensors)} tensors; at most {MAX_TENSORS} allowed")
    specs = tuple(spec_from_proto(s) for s in header.tensors)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise _invalid("a tensor name appears twice in the payload header")
    if len(header.sha256) != 32:
        raise _invalid("payload sha256 must be 32 bytes")
    needed = sum(s.nbytes for s in specs)
    if header.total_bytes != needed:
        raise _invalid(f"payload header says {header.total_bytes} bytes; its tensors need {needed}")
    if header.wire_bytes >= max(header.total_bytes, 1):
        raise _invalid(f"a zstd stream of {header.wire_bytes} bytes for a payload of "
                       f"{header.total_bytes}: compressed payloads must be smaller (send it plain)")
    return PayloadInfo(specs, int(header.total_bytes), bytes(header.sha256),
                       int(header.wire_bytes))


def chunks_for_push(pieces: Iterable[tuple[int, bytes]]) -> Iterable[ProtoPushRequest]:
    for offset, data in pieces:
        yield ProtoPushRequest(chunk=ProtoChunk(offset=offset, data=data))


def chunk_from_proto(chunk: ProtoChunk) -> tuple[int, bytes]:
    return int(chunk.offset), chunk.data


# ---- sessions and join ----------------------------------------------------------
def session_to_proto(session: Session) -> ProtoSession:
    return ProtoSession(client_id=session.client_id, secret=session.secret)


def session_from_proto(session: ProtoSession) -> Session:
    _check_text(session.client_id, "client_id")
    if len(session.secret) > 256:
        raise _invalid("session secret is too long")
    return Session(session.client_id, bytes(session.secret))


def join_request_to_proto(request: JoinRequest) -> ProtoJoinRequest:
    return ProtoJoinRequest(
        protocol_version=request.protocol_version,
        capabilities=sorted(request.capabilities),
        name=request.name,
        token=request.token,
        upload_codecs=list(request.upload_codecs),
        download_codecs=list(request.download_codecs),
    )


def join_request_from_proto(request: ProtoJoinRequest) -> JoinRequest:
    if len(request.capabilities) > MAX_CAPABILITIES:
        raise _invalid(f"at most {MAX_CAPABILITIES} capabilities allowed")
    for cap in request.capabilities:
        _check_text(cap, "capability")
    return JoinRequest(
        protocol_version=request.protocol_version,
        capabilities=frozenset(request.capabilities),
        name=_check_text(request.name, "name"),
        token=_check_text(request.token, "token", 1024, printable=False),
        upload_codecs=asked_codecs(request.upload_codecs, "upload_codecs"),
        download_codecs=asked_codecs(request.download_codecs, "download_codecs"),
    )


def join_reply_to_proto(reply: JoinReply) -> ProtoJoinResponse:
    response = ProtoJoinResponse(
        session=session_to_proto(reply.session),
        protocol_version=reply.protocol_version,
        capabilities=sorted(reply.capabilities),
        run_id=reply.run_id,
        heartbeat_interval_s=reply.heartbeat_interval_s,
        long_poll_s=reply.long_poll_s,
        chunk_size=reply.chunk_size,
        max_message_bytes=reply.max_message_bytes,
        max_model_bytes=reply.max_model_bytes,
    )
    grants_to_proto(reply, response)
    return response


def join_reply_from_proto(reply: ProtoJoinResponse) -> JoinReply:
    for name in ("heartbeat_interval_s", "long_poll_s"):
        value = getattr(reply, name)
        if not (math.isfinite(value) and MIN_INTERVAL_S <= value <= 3600):
            raise _invalid(f"{name} {value} is out of range ({MIN_INTERVAL_S}..3600 s)")
    if reply.chunk_size < MIN_CHUNK_BYTES or reply.chunk_size > reply.max_message_bytes:
        raise _invalid(f"chunk_size must be at least {MIN_CHUNK_BYTES} and fit in "
                       "max_message_bytes")
    if len(reply.capabilities) > MAX_CAPABILITIES:
        raise _invalid(f"at most {MAX_CAPABILITIES} capabilities allowed")
    for cap in reply.capabilities:
        _check_text(cap, "capability")
    return JoinReply(
        session=session_from_proto(reply.session),
        protocol_version=reply.protocol_version,
        capabilities=frozenset(reply.capabilities),
        run_id=_check_text(reply.run_id, "run_id"),
        heartbeat_interval_s=reply.heartbeat_interval_s,
        long_poll_s=reply.long_poll_s,
        chunk_size=int(reply.chunk_size),
        max_message_bytes=int(reply.max_message_bytes),
        max_model_bytes=int(reply.max_model_bytes),
        **grants_from_proto(reply),
    )


# ---- tasks ----------------------------------------------------------------------
def task_to_proto(task: TaskHeader, inline: bytes | memoryview | None = None
                  ) -> ProtoPullResponse:
    """The task's header message; ``inline``: its whole (small) payload, carried in
    the header (``TaskHeader.inline_payload``) instead of in Chunks."""
    header = ProtoTaskHeader(
        task_id=task.task_id,
        run_id=task.run_id,
        round=task.round,
        deadline_s=task.deadline_s,
        weights=payload_to_proto(task.weights),
        decoded_tensors=[spec_to_proto(s) for s in task.decoded],
    )
    encoding = header_encoding(task.codec, task.weights)
    if encoding is not None:
        header.encoding.CopyFrom(encoding)
    config = record_to_proto(task.config)
    if task.kind is TaskKind.FIT:
        header.fit.CopyFrom(ProtoFitTask(config=config))
    elif task.kind is TaskKind.EVALUATE:
        header.evaluate.CopyFrom(ProtoEvaluateTask(config=config))
    else:
        secagg_task_to_proto(task.secagg, config, header)
    if inline is not None:
        header.inline_payload = bytes(inline)
    return ProtoPullResponse(task=header)


def task_from_proto(header: ProtoTaskHeader) -> TaskHeader:
    kind = header.WhichOneof("kind")
    secagg = None
    config: ProtoRecord | None
    if kind == "fit":
        task_kind, config = TaskKind.FIT, header.fit.config
    elif kind == "evaluate":
        task_kind, config = TaskKind.EVALUATE, header.evaluate.config
    elif kind is not None and kind.startswith("secagg_"):
        task_kind = TaskKind.SECAGG
        secagg, config = secagg_task_from_proto(header, kind)
    else:
        raise _invalid(f"task kind {kind!r} is not supported by this client")
    if not (math.isfinite(header.deadline_s) and header.deadline_s >= 0):
        raise _invalid("task deadline is not a non-negative number")
    if header.round < 1:
        raise _invalid("task round must be at least 1 (round 0 is the initial model)")
    weights = payload_from_proto(header.weights)
    encoding, decoded = task_encoding(header, task_kind is TaskKind.SECAGG, weights,
                                      spec_from_proto, MAX_TENSORS)
    return TaskHeader(
        task_id=_check_text(header.task_id, "task_id"),
        run_id=_check_text(header.run_id, "run_id"),
        round=int(header.round),
        kind=task_kind,
        config=record_from_proto(config, "task config") if config is not None else {},
        deadline_s=header.deadline_s,
        weights=weights,
        secagg=secagg,
        codec=encoding,
        decoded=decoded,
    )


def no_task_to_proto(no_task: NoTask) -> ProtoPullResponse:
    return ProtoPullResponse(
        no_task=ProtoNoTask(retry_after_s=no_task.retry_after_s, run_finished=no_task.run_finished)
    )


def no_task_from_proto(no_task: ProtoNoTask) -> NoTask:
    retry = no_task.retry_after_s
    return NoTask(min(max(retry, 0.0), 60.0) if math.isfinite(retry) else 1.0, no_task.run_finished)


# ---- results --------------------------------------------------------------------
def result_to_proto(result: ResultHeader, inline: bytes | memoryview | None = None
                    ) -> ProtoPushRequest:
    """The result's header message; ``inline``: the whole (small) payload its update
    describes, carried in the header (``ResultHeader.inline_payload``, for Report)."""
    header = ProtoResultHeader(
        session=session_to_proto(result.session), task_id=result.task_id, round=result.round
    )
    if result.update is not None:
        header.update.CopyFrom(payload_to_proto(result.update))
    encoding = header_encoding(result.codec, result.update)
    if encoding is not None:
        header.encoding.CopyFrom(encoding)
    metrics = record_to_proto(result.metrics)
    if result.kind is TaskKind.FIT:
        header.fit.CopyFrom(
            ProtoFitResult(
                num_examples=result.num_examples, base_round=result.base_round, metrics=metrics
            )
        )
    elif result.kind is TaskKind.EVALUATE:
        header.evaluate.CopyFrom(
            ProtoEvaluateResult(num_examples=result.num_examples, loss=result.loss, metrics=metrics)
        )
    elif result.kind is TaskKind.SECAGG:
        secagg_result_to_proto(result.secagg, header)
    else:
        header.failure.CopyFrom(ProtoTaskFailure(message=result.failure[:MAX_TEXT]))
    if inline is not None:
        header.inline_payload = bytes(inline)
    return ProtoPushRequest(result=header)


def result_from_proto(header: ProtoResultHeader) -> ResultHeader:
    session = session_from_proto(header.session)
    task_id = _check_text(header.task_id, "task_id")
    kind = header.WhichOneof("kind")
    update = payload_from_proto(header.update) if header.HasField("update") else None
    rnd = int(header.round)
    encoding = result_encoding(header, kind, update)
    if kind == "fit":
        if update is None:
            raise _invalid("a fit result must carry an update payload header")
        return ResultHeader(
            session=session,
            task_id=task_id,
            round=rnd,
            kind=TaskKind.FIT,
            num_examples=int(header.fit.num_examples),
            base_round=int(header.fit.base_round),
            metrics=record_from_proto(header.fit.metrics, "fit metrics"),
            update=update,
            codec=encoding,
        )
    if kind == "evaluate":
        if not math.isfinite(header.evaluate.loss):
            raise _invalid("evaluation loss is NaN or infinite")
        return ResultHeader(
            session=session,
            task_id=task_id,
            round=rnd,
            kind=TaskKind.EVALUATE,
            num_examples=int(header.evaluate.num_examples),
            loss=header.evaluate.loss,
            metrics=record_from_proto(header.evaluate.metrics, "evaluate metrics"),
        )
    if kind == "failure":
        return ResultHeader(
            session=session,
            task_id=task_id,
            round=rnd,
            kind=None,
            # Logged and recorded: escaped, so it cannot forge log lines (one_line).
            failure=one_line(_check_text(
                header.failure.message, "failure message", MAX_TEXT, printable=False
            ), MAX_TEXT),
        )
    if kind is None or not kind.startswith("secagg_"):
        raise _invalid("result header has no kind (fit, evaluate, a secagg stage or failure)")
    return ResultHeader(
        session=session, task_id=task_id, round=rnd, kind=TaskKind.SECAGG, update=update,
        secagg=secagg_result_from_proto(header, kind, update),
    )
