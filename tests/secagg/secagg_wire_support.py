"""What the wire tests of the secure-aggregation stages share: a session, an empty
payload, a signature, headers around one stage message, and the INVALID check."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.messages import MASKED_TENSOR, Session
from fedloom.payload import PayloadInfo
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.weights import TensorSpec

SESSION = Session("client-000", b"s" * 32)
EMPTY = PayloadInfo((), 0, hashlib.sha256(b"").digest())
SIGNATURE = b"\x30" * 70


def masked_info(length: int) -> PayloadInfo:
    spec = TensorSpec(MASKED_TENSOR, "uint32", (length,))
    return PayloadInfo((spec,), spec.nbytes, b"\0" * 32)


def task_with(kind: str, message: Any) -> pb.TaskHeader:
    """A task header whose oneof ``kind`` is ``message``."""
    header = pb.TaskHeader(task_id="t", run_id="r", round=1, weights=codec.payload_to_proto(EMPTY))
    getattr(header, kind).CopyFrom(message)
    return header


def refused(parse: Any, header: Any, match: str | None = None) -> MessageRejectedError:
    with pytest.raises(MessageRejectedError, match=match) as info:
        parse(header)
    assert info.value.reason is RejectReason.INVALID
    return info.value
