"""A large push goes over a connection of its own, closed when the push ends, so the
server's gRPC frees the read buffers it grew for the upload; small pushes, and every
push with ``separate_upload_connection`` off, use the client's long-lived channel."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import psutil
import pytest
from helpers import fake_fleet

from fedloom.client_sdk.connection import (
    SEPARATE_UPLOAD_MIN_BYTES,
    Connection,
    ResultRefusedError,
)
from fedloom.config import ClientConfig, TransferConfig
from fedloom.messages import PROTOCOL_VERSION, JoinReply, ResultHeader, Session
from fedloom.payload import PayloadInfo
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc
from fedloom.types import TaskKind
from fedloom.weights import TensorSpec

CHUNK = 16 * 1024


class PeerRecorder(pb_grpc.FleetServicer):
    """Records the peer (client address and port) of each call and the bytes pushed."""

    def __init__(self) -> None:
        self.peers: dict[str, list[str]] = {"Join": [], "Push": []}
        self.pushed: list[bytes] = []
        self.refuse = False
        self.lock = threading.Lock()

    def Join(self, request: Any, context: Any) -> pb.JoinResponse:
        with self.lock:
            self.peers["Join"].append(context.peer())
        reply = JoinReply(Session("c1", b"s" * 32), PROTOCOL_VERSION, frozenset({"fit"}),
                          "run-1", 5.0, 1.0, CHUNK, 4 * CHUNK, 1 << 22)  # fmt: skip
        return codec.join_reply_to_proto(reply)

    def Push(self, request_iterator: Iterator[pb.PushRequest], context: Any) -> pb.PushResponse:
        data = bytearray()
        for message in request_iterator:
            if message.WhichOneof("part") == "chunk":
                data += message.chunk.data
        with self.lock:
            self.peers["Push"].append(context.peer())
            self.pushed.append(bytes(data))
        if self.refuse:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused for the test")
        return pb.PushResponse(duplicate=False)


@pytest.fixture()
def recorder():  # type: ignore[no-untyped-def]
    servicer = PeerRecorder()
    with fake_fleet(servicer) as address:
        yield servicer, address


def _connect(address: str, separate: bool = True) -> Connection:
    transfer = TransferConfig(chunk_size=CHUNK, max_message_bytes=4 * CHUNK,
                              max_model_bytes=1 << 22)  # fmt: skip
    connection = Connection(ClientConfig(server_address=address, rpc_timeout_s=5.0,
                                         transfer=transfer, insecure=True,
                                         separate_upload_connection=separate))  # fmt: skip
    connection.join("c1")
    return connection


def _result(size: int) -> tuple[ResultHeader, memoryview]:
    payload = bytes(i % 251 for i in range(size))
    info = PayloadInfo.describe((TensorSpec("w", "uint8", (size,)),), payload)
    header = ResultHeader(Session("c1", b"s" * 32), "t1", 1, TaskKind.FIT, num_examples=1,
                          base_round=0, update=info)  # fmt: skip
    return header, memoryview(payload)


def _connections_to(address: str) -> int:
    port = int(address.rsplit(":", 1)[1])
    return sum(
        1 for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


def test_a_large_push_uses_its_own_connection_and_closes_it(recorder) -> None:  # type: ignore[no-untyped-def]
    servicer, address = recorder
    connection = _connect(address)
    try:
        size = SEPARATE_UPLOAD_MIN_BYTES + 3 * CHUNK + 5
        header, payload = _result(size)
        for _ in range(3):
            assert connection.push(header, payload) is False
        join_peer = servicer.peers["Join"][0]
        push_peers = servicer.peers["Push"]
        assert len(push_peers) == 3
        assert join_peer not in push_peers  # not on the long-lived channel
        assert len(set(push_peers)) == 3  # a fresh connection each time
        assert all(p == bytes(payload) for p in servicer.pushed)
        assert _connections_to(address) == 1  # the upload connections are closed
    finally:
        connection.close()


@pytest.mark.parametrize(
    ("size", "separate"),
    [(SEPARATE_UPLOAD_MIN_BYTES - 1, True), (2 * SEPARATE_UPLOAD_MIN_BYTES, False)],
    ids=["small push", "setting off"],
)
def test_a_push_stays_on_the_long_lived_channel(recorder, size: int, separate: bool) -> None:  # type: ignore[no-untyped-def]
    """Small pushes, and every push with the setting off, share the client's channel."""
    servicer, address = recorder
    connection = _connect(address, separate=separate)
    try:
        header, payload = _result(size)
        connection.push(header, payload)
        assert servicer.peers["Push"] == servicer.peers["Join"]
        assert servicer.pushed == [bytes(payload)]
    finally:
        connection.close()


def test_a_refusal_on_the_upload_connection_is_translated(recorder) -> None:  # type: ignore[no-untyped-def]
    servicer, address = recorder
    servicer.refuse = True
    connection = _connect(address)
    try:
        header, payload = _result(SEPARATE_UPLOAD_MIN_BYTES)
        with pytest.raises(ResultRefusedError, match="refused for the test"):
            connection.push(header, payload)
        assert _connections_to(address) == 1
    finally:
        connection.close()
