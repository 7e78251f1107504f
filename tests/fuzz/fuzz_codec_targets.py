"""Fuzz targets for the codec and the payload receiver (shared by the CI tests and
``benchmarks/fuzz.py``).

Messages are generated from the protobuf *descriptors*, so every field of every message
(the secure-aggregation stages included) gets random and edge-case values, nested and
with oneofs chosen at random; a second source mutates the bytes of valid messages
(bit flips, insertions, deletions, truncation) and parses whatever still parses. The
property: a decoder (``x_from_proto``) returns a domain value or raises
`MessageRejectedError`, never anything else, and a value it returns re-encodes and
decodes to itself.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import strategies as st

from fedloom.errors import MessageRejectedError
from fedloom.payload import PayloadReceiver
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.weights import SUPPORTED_DTYPES

_F = FieldDescriptor

# Values an attacker would try first, by field type.
_EDGE_UINT = [0, 1, 2, 31, 32, 33, 255, 1 << 20, (1 << 31) - 1, 1 << 32, 1 << 40, (1 << 40) + 1,
              1 << 53, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]  # fmt: skip
_EDGE_INT = [0, 1, -1, (1 << 31) - 1, -(1 << 31), (1 << 63) - 1, -(1 << 63)]
_EDGE_FLOAT = [0.0, -0.0, 1e-300, 0.5, 1.0, 3600.0, 3600.5, 1e300, math.inf, -math.inf, math.nan]
_WORDS = ["", "fit", "evaluate", "secagg", "w", "b", "float32", "int64", "bool", "float16",
          "\n", "a\x00b", "é", "💥", "x" * 129, "y" * 513, "z" * 5000]  # fmt: skip
_DTYPES = [*SUPPORTED_DTYPES, "float128", "complex64", "object", ""]

_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    _F.TYPE_BOOL: st.booleans(),
    _F.TYPE_UINT32: st.sampled_from([0, 1, 2, 255, (1 << 32) - 1]) | st.integers(0, (1 << 32) - 1),
    _F.TYPE_UINT64: st.sampled_from(_EDGE_UINT) | st.integers(0, (1 << 64) - 1),
    _F.TYPE_INT32: st.integers(-(1 << 31), (1 << 31) - 1),
    _F.TYPE_INT64: st.sampled_from(_EDGE_INT) | st.integers(-(1 << 63), (1 << 63) - 1),
    _F.TYPE_SINT64: st.sampled_from(_EDGE_INT) | st.integers(-(1 << 63), (1 << 63) - 1),
    _F.TYPE_DOUBLE: st.sampled_from(_EDGE_FLOAT) | st.floats(allow_nan=True),
    _F.TYPE_FLOAT: st.sampled_from(_EDGE_FLOAT) | st.floats(width=32, allow_nan=True),
    _F.TYPE_STRING: st.sampled_from(_WORDS) | st.text(max_size=40),
    _F.TYPE_BYTES: st.sampled_from([b"", b"\x00" * 32, b"\x01" * 33, b"\xff" * 64])
    | st.binary(max_size=80),
}


def _field_strategy(field: Any, depth: int) -> st.SearchStrategy[Any] | None:
    if field.type == _F.TYPE_MESSAGE:
        if depth <= 0:
            return None
        return messages(field.message_type, depth - 1)
    if field.type == _F.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values])
    if field.name == "dtype":
        return st.sampled_from(_DTYPES)
    return _SCALARS.get(field.type)


def messages(descriptor: Any, depth: int = 4) -> st.SearchStrategy[Message]:
    """Random instances of the message ``descriptor`` describes (fields set at random)."""
    cls = _message_class(descriptor)

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        message = cls()
        oneof_choice = {
            o.name: draw(st.sampled_from([None, *[f.name for f in o.fields]]))
            for o in descriptor.oneofs
        }
        for field in descriptor.fields:
            oneof = field.containing_oneof
            if oneof is not None and oneof_choice[oneof.name] != field.name:
                continue
            if oneof is None and not draw(st.booleans()):
                continue  # leave it at its default
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                _fill_map(draw, message, field, depth)
                continue
            strategy = _field_strategy(field, depth)
            if strategy is None:
                continue
            if field.is_repeated:
                values = draw(st.lists(strategy, max_size=4))
                target = getattr(message, field.name)
                for value in values:
                    if field.type == _F.TYPE_MESSAGE:
                        target.add().CopyFrom(value)
                    else:
                        target.append(value)
            elif field.type == _F.TYPE_MESSAGE:
                getattr(message, field.name).CopyFrom(draw(strategy))
            else:
                setattr(message, field.name, draw(strategy))
        return message

    return build()


def _fill_map(draw: st.DrawFn, message: Message, field: Any, depth: int) -> None:
    key_field = field.message_type.fields_by_name["key"]
    value_field = field.message_type.fields_by_name["value"]
    keys = draw(st.lists(_SCALARS[key_field.type], max_size=4, unique=True))
    target = getattr(message, field.name)
    for key in keys:
        if value_field.type == _F.TYPE_MESSAGE:
            if depth <= 0:
                return
            target[key].CopyFrom(draw(messages(value_field.message_type, depth - 1)))
        else:
            target[key] = draw(_SCALARS[value_field.type])


def _message_class(descriptor: Any) -> type[Message]:
    cls: type[Message] = getattr(pb, descriptor.name)
    return cls


# ---- decoders under test ---------------------------------------------------------
#: (proto class, decoder) for every ``x_from_proto`` that takes a whole message.
DECODERS: list[tuple[type[Message], Callable[[Any], Any], Callable[[Any], Any] | None]] = [
    (pb.Session, codec.session_from_proto, codec.session_to_proto),
    (pb.JoinRequest, codec.join_request_from_proto, codec.join_request_to_proto),
    (pb.JoinResponse, codec.join_reply_from_proto, codec.join_reply_to_proto),
    (pb.TaskHeader, codec.task_from_proto, lambda t: codec.task_to_proto(t).task),
    (pb.NoTask, codec.no_task_from_proto, lambda n: codec.no_task_to_proto(n).no_task),
    (pb.ResultHeader, codec.result_from_proto, lambda r: codec.result_to_proto(r).result),
    (pb.PayloadHeader, codec.payload_from_proto, codec.payload_to_proto),
    (pb.TensorSpec, codec.spec_from_proto, codec.spec_to_proto),
    (pb.Record, lambda r: codec.record_from_proto(r, "fuzz"), codec.record_to_proto),
    (pb.Value, codec.value_from_proto, codec.value_to_proto),
    (pb.Chunk, codec.chunk_from_proto, None),
]


class UnexpectedError(AssertionError):
    """A decoder raised something other than `MessageRejectedError`."""


def check_decoder(
    decode: Callable[[Any], Any], encode: Callable[[Any], Any] | None, message: Message
) -> bool:
    """Decode; True if accepted. Only `MessageRejectedError` may come out; an accepted
    value must survive encode -> decode unchanged."""
    try:
        value = decode(message)
    except MessageRejectedError:
        return False
    except Exception as exc:  # the property under test
        raise UnexpectedError(
            f"{getattr(decode, '__name__', decode)} raised {type(exc).__name__}: {exc}\n"
            f"input: {message!r}"[:3000]
        ) from exc
    _check_accepted(value)
    if encode is not None:
        again = decode(encode(value))
        if not _same(again, value):
            raise UnexpectedError(f"round trip changed the value: {value!r} -> {again!r}")
    return True


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def _check_accepted(value: Any) -> None:
    """Invariants of accepted values that the server and client rely on."""
    from fedloom.payload import PayloadInfo

    infos = [value] if isinstance(value, PayloadInfo) else []
    for attr in ("weights", "update"):
        info = getattr(value, attr, None)
        if isinstance(info, PayloadInfo):
            infos.append(info)
    for info in infos:
        total = 0
        for spec in info.specs:
            exact = math.prod(spec.shape) * spec.numpy_dtype.itemsize
            assert spec.nbytes == exact, f"{spec}: nbytes {spec.nbytes} != {exact} (overflow)"
            total += exact
        assert info.total_bytes == total < (1 << 62)


def mutate(data: bytes, ops: list[tuple[int, int, int]]) -> bytes:
    """Apply (kind, position, byte) edits: 0 flip a bit, 1 insert, 2 delete, 3 truncate."""
    out = bytearray(data)
    for kind, pos, byte in ops:
        if not out and kind != 1:
            continue
        at = pos % (len(out) + 1)
        if kind == 0 and out:
            out[at % len(out)] ^= 1 << (byte % 8)
        elif kind == 1:
            out.insert(at, byte)
        elif kind == 2 and out:
            del out[at % len(out)]
        elif kind == 3:
            del out[at:]
    return bytes(out)


def parse_or_none(cls: type[Message], data: bytes) -> Message | None:
    try:
        return cls.FromString(data)
    except DecodeError:
        return None  # gRPC answers INTERNAL ("Exception deserializing request")


# ---- the payload receiver ----------------------------------------------------------
class _Sink:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data


def check_receiver(info_message: Any, payload: bytes, pieces: list[tuple[int, bytes]]) -> bool:
    """Feed chunks to a `PayloadReceiver` built from a (possibly hostile) header; True if
    the payload was accepted, which must happen only for the exact declared bytes."""
    try:
        info = codec.payload_from_proto(info_message)
        sink = _Sink()
        receiver = PayloadReceiver(
            info.specs, info.total_bytes, info.sha256, sink, max_chunk_bytes=1 << 16
        )
        for offset, data in pieces:
            receiver.feed(offset, data)
        receiver.finish()
    except MessageRejectedError:
        return False
    except Exception as exc:
        raise UnexpectedError(f"receiver raised {type(exc).__name__}: {exc}") from exc
    if bytes(sink.data) != payload or hashlib.sha256(payload).digest() != info.sha256:
        raise UnexpectedError("the receiver accepted bytes other than the declared payload")
    return True


# ---- valid messages (seeds for mutation, and the accepted side of the property) -----
_NAMES = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=12)
_SCALAR_VALUES = (
    st.booleans()
    | st.integers(-(1 << 63), (1 << 63) - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
_RECORDS = st.dictionaries(_NAMES, _SCALAR_VALUES, max_size=4)


@st.composite
def payload_infos(draw: st.DrawFn) -> Any:
    from fedloom.payload import PayloadInfo
    from fedloom.weights import TensorSpec

    names = draw(st.lists(_NAMES, max_size=4, unique=True))
    specs = tuple(
        TensorSpec(
            name,
            draw(st.sampled_from(list(SUPPORTED_DTYPES))),
            tuple(draw(st.lists(st.integers(0, 9), max_size=3))),
        )
        for name in names
    )
    total = sum(s.nbytes for s in specs)
    return PayloadInfo(specs, total, draw(st.binary(min_size=32, max_size=32)))


@st.composite
def _valid(draw: st.DrawFn, cls: type[Message]) -> Message:
    from fedloom.messages import (
        PROTOCOL_VERSION,
        JoinReply,
        JoinRequest,
        NoTask,
        ResultHeader,
        Session,
        TaskHeader,
    )
    from fedloom.types import TaskKind

    ids = st.text("0123456789abcdef", min_size=1, max_size=32)
    session = Session(draw(ids), draw(st.binary(min_size=32, max_size=32)))
    if cls is pb.Session:
        return codec.session_to_proto(session)
    if cls is pb.JoinRequest:
        caps = frozenset(draw(st.lists(st.sampled_from(["fit", "evaluate", "secagg"]))))
        return codec.join_request_to_proto(
            JoinRequest(PROTOCOL_VERSION, caps, draw(_NAMES), draw(st.text(max_size=30)))
        )
    if cls is pb.JoinResponse:
        chunk = draw(st.integers(1024, 1 << 20))
        return codec.join_reply_to_proto(
            JoinReply(
                session,
                PROTOCOL_VERSION,
                frozenset({"fit", "evaluate"}),
                draw(ids),
                draw(st.floats(0.01, 3600)),
                draw(st.floats(0.01, 3600)),
                chunk,
                chunk + 16384,
                draw(st.integers(1, 1 << 40)),
            )
        )
    kind = draw(st.sampled_from([TaskKind.FIT, TaskKind.EVALUATE]))
    if cls is pb.TaskHeader:
        rnd, config = draw(st.integers(1, 1 << 40)), draw(_RECORDS)
        task = TaskHeader(
            draw(ids), draw(ids), rnd, kind, config, draw(st.floats(0, 1e6)), draw(payload_infos())
        )
        return codec.task_to_proto(task).task
    if cls is pb.ResultHeader:
        common = dict(session=session, task_id=draw(ids), round=draw(st.integers(0, 1 << 40)))
        if draw(st.booleans()):
            return codec.result_to_proto(
                ResultHeader(kind=None, failure=draw(st.text(max_size=100)), **common)  # type: ignore[arg-type]
            ).result
        result = ResultHeader(
            kind=kind,
            num_examples=draw(st.integers(0, 1 << 40)),
            base_round=draw(st.integers(0, 1 << 40)),
            loss=draw(st.floats(allow_nan=False, allow_infinity=False)),
            metrics=draw(_RECORDS),
            update=draw(payload_infos()) if kind is TaskKind.FIT else None,
            **common,  # type: ignore[arg-type]
        )
        return codec.result_to_proto(result).result
    if cls is pb.PayloadHeader:
        return codec.payload_to_proto(draw(payload_infos()))
    if cls is pb.Record:
        return codec.record_to_proto(draw(_RECORDS))
    if cls is pb.NoTask:
        return codec.no_task_to_proto(NoTask(draw(st.floats(0, 60)), draw(st.booleans()))).no_task
    return draw(messages(cls.DESCRIPTOR))


def valid_or_random(cls: type[Message]) -> st.SearchStrategy[Message]:
    """Well-formed messages (from domain values) or random ones, half and half."""
    return _valid(cls) | messages(cls.DESCRIPTOR)
