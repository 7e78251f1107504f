"""Speaking the Fleet protocol by hand over a real channel, to send what a well-behaved
SDK never would: mangled headers, chunks out of order, truncated streams, raw bytes."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import grpc

from fedloom.messages import PROTOCOL_VERSION, JoinRequest, ResultHeader, Session, TaskHeader
from fedloom.payload import PayloadInfo, iter_chunks, serialize
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc
from fedloom.types import TaskKind
from fedloom.weights import Weights

SERVICE = "/fedloom.v1.Fleet/"
#: Statuses a hostile call may earn. UNKNOWN would mean an unhandled exception in a
#: handler; INTERNAL is gRPC's answer to bytes that do not parse as the request type.
CLEAR_STATUSES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}
UNPARSEABLE = grpc.StatusCode.INTERNAL


def channel(address: str, max_message_bytes: int = 64 << 20) -> grpc.Channel:
    return grpc.insecure_channel(
        address,
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.use_local_subchannel_pool", 1),
        ],
    )


class RawClient:
    """A joined session and its stub, plus untyped (bytes in, bytes out) calls."""

    def __init__(self, address: str, name: str = "raw", capabilities: Iterable[str] = ("fit",)):
        self.channel = channel(address)
        self.stub = pb_grpc.FleetStub(self.channel)
        request = JoinRequest(PROTOCOL_VERSION, frozenset(capabilities), name)
        reply = self.stub.Join(codec.join_request_to_proto(request), timeout=10)
        self.session: Session = codec.join_reply_from_proto(reply).session

    def close(self) -> None:
        self.channel.close()

    @property
    def session_proto(self) -> pb.Session:
        return codec.session_to_proto(self.session)

    def fit_result(self, task: TaskHeader, delta: Weights) -> tuple[ResultHeader, bytes]:
        """A fit result for ``task`` carrying ``delta`` (one example), and its payload."""
        payload = bytes(serialize(delta))
        header = ResultHeader(
            self.session, task.task_id, task.round, TaskKind.FIT, num_examples=1,
            base_round=task.round - 1, update=PayloadInfo.describe(delta.specs(), payload),
        )  # fmt: skip
        return header, payload

    def pull_task(self, timeout_s: float = 20.0) -> TaskHeader:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            messages = list(self.stub.Pull(pb.PullRequest(session=self.session_proto), timeout=10))
            if messages[0].WhichOneof("part") == "task":
                return codec.task_from_proto(messages[0].task)
        raise AssertionError("no task arrived")

    def push(
        self, header: ResultHeader | pb.PushRequest, pieces: Iterable[tuple[int, bytes]] = ()
    ) -> pb.PushResponse:
        def requests() -> Iterator[pb.PushRequest]:
            yield header if isinstance(header, pb.PushRequest) else codec.result_to_proto(header)
            yield from codec.chunks_for_push(pieces)

        return self.stub.Push(requests(), timeout=10)

    # -- untyped calls: any bytes, as the request of any method ------------------------
    def raw_unary(self, method: str, data: bytes, timeout_s: float = 10.0) -> bytes:
        call = self.channel.unary_unary(
            SERVICE + method, request_serializer=None, response_deserializer=None
        )
        return call(data, timeout=timeout_s)

    def raw_stream_in(self, method: str, parts: list[bytes], timeout_s: float = 10.0) -> bytes:
        call = self.channel.stream_unary(
            SERVICE + method, request_serializer=None, response_deserializer=None
        )
        return call(iter(parts), timeout=timeout_s)

    def raw_stream_out(self, method: str, data: bytes, timeout_s: float = 10.0) -> list[bytes]:
        call = self.channel.unary_stream(
            SERVICE + method, request_serializer=None, response_deserializer=None
        )
        return list(call(data, timeout=timeout_s))


def status_of(fn: Any, *args: Any, **kwargs: Any) -> tuple[grpc.StatusCode, str]:
    """Run a call; return its status code and details (OK and "" when it succeeded)."""
    try:
        fn(*args, **kwargs)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def chunked(payload: bytes, size: int = 1 << 12) -> list[tuple[int, bytes]]:
    return list(iter_chunks(payload, size))
