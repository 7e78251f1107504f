"""A large push goes over a connection of its own, closed when the push ends, so the
server's gRPC frees the read buffers it grew for the upload; small pushes, and every
push with ``separate_upload_connection`` off, use the client's long-lived channel. The
connection is opened when a task with a large model arrives, so its handshake overlaps
the training instead of delaying the push."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import psutil
import pytest
from helpers import fake_fleet

from fedloom.client_sdk import connection as connection_module
from fedloom.client_sdk.connection import (
    SEPARATE_UPLOAD_MIN_BYTES,
    Connection,
    ResultRefusedError,
)
from fedloom.config import ClientConfig, TransferConfig
from fedloom.messages import PROTOCOL_VERSION, JoinReply, ResultHeader, Session, TaskHeader
from fedloom.payload import PayloadInfo, iter_chunks, serialize
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc
from fedloom.types import TaskKind
from fedloom.weights import TensorSpec, Weights

CHUNK = 16 * 1024
MODEL = Weights({"w": np.zeros(SEPARATE_UPLOAD_MIN_BYTES // 4 + 10, np.float32)})


class PeerRecorder(pb_grpc.FleetServicer):
    """Records the peer (client address and port) of each call and the bytes pushed."""

    def __init__(self) -> None:
        self.peers: dict[str, list[str]] = {"Join": [], "Push": [], "Report": []}
        self.pushed: list[bytes] = []
        self.refuse = False
        self.kind = TaskKind.FIT  # of the task Pull hands out
        self.lock = threading.Lock()

    def Join(self, request: Any, context: Any) -> pb.JoinResponse:
        with self.lock:
            self.peers["Join"].append(context.peer())
        reply = JoinReply(Session("c1", b"s" * 32), PROTOCOL_VERSION, frozenset({"fit"}),
                          "run-1", 5.0, 1.0, CHUNK, 4 * CHUNK, 1 << 22)  # fmt: skip
        return codec.join_reply_to_proto(reply)

    def Tasks(self, request: Any, context: Any) -> Iterator[pb.PullResponse]:
        yield from self.Pull(request, context)
        while context.is_active():  # no next task: the stream stays open, as a server's
            time.sleep(0.02)

    def Report(self, request: pb.PushRequest, context: Any) -> pb.PushResponse:
        with self.lock:
            self.peers["Report"].append(context.peer())
        return pb.PushResponse(duplicate=False)

    def Pull(self, request: Any, context: Any) -> Iterator[pb.PullResponse]:
        payload = bytes(serialize(MODEL))
        info = PayloadInfo.describe(MODEL.specs(), payload)
        yield codec.task_to_proto(TaskHeader("t1", "run-1", 1, self.kind, {}, 10.0, info))
        for offset, data in iter_chunks(payload, CHUNK):
            yield pb.PullResponse(chunk=pb.Chunk(offset=offset, data=data))

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


def _local_ports(address: str) -> set[int]:
    """This process's ports of its established connections to ``address``."""
    port = int(address.rsplit(":", 1)[1])
    return {
        c.laddr.port for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    }


def _connections_to(address: str) -> int:
    return len(_local_ports(address))


def _port(peer: str) -> int:
    return int(peer.rsplit(":", 1)[1])


def _wait_for(predicate: Any, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


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
        # the upload connections are closed (gRPC tears a closed channel's socket down
        # in the background, so wait a bounded while)
        assert _wait_for(lambda: _connections_to(address) == 1)
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


def test_a_large_task_opens_the_upload_connection_before_the_push(recorder) -> None:  # type: ignore[no-untyped-def]
    servicer, address = recorder
    connection = _connect(address)
    try:
        main = _port(servicer.peers["Join"][0])
        pulled = connection.pull()
        assert isinstance(pulled, tuple) and pulled[1].allclose(MODEL, rtol=0, atol=0)
        # connecting while the client would train: the main channel and one more
        assert _wait_for(lambda: len(_local_ports(address)) == 2)
        (prepared,) = _local_ports(address) - {main}
        header, payload = _result(MODEL["w"].nbytes)
        connection.push(header, payload)
        assert [_port(p) for p in servicer.peers["Push"]] == [prepared]  # the prepared one
        assert _wait_for(lambda: _local_ports(address) == {main})  # and closed after it
    finally:
        connection.close()
    assert _wait_for(lambda: _connections_to(address) == 0)


@pytest.mark.parametrize(("kind", "channels"), [(TaskKind.FIT, 2), (TaskKind.EVALUATE, 1)])
def test_only_a_task_answered_with_an_update_opens_an_upload_connection(
    recorder: tuple[PeerRecorder, str], monkeypatch: pytest.MonkeyPatch, kind: TaskKind,
    channels: int,
) -> None:
    """The upload channel is opened (or not) before `pull` returns the task: counting
    the channels the connection opened then needs no wait. An evaluation is answered
    without an update, so a large model alone opens none."""
    servicer, address = recorder
    servicer.kind = kind
    opened: list[str] = []
    real = connection_module.open_channel

    def counting(config: ClientConfig, options: Any) -> grpc.Channel:
        opened.append(config.server_address)
        return real(config, options)

    monkeypatch.setattr(connection_module, "open_channel", counting)
    connection = _connect(address)
    try:
        assert opened == [address]  # the long-lived channel
        assert isinstance(connection.pull(), tuple)
        assert opened == [address] * channels
    finally:
        connection.close()


def test_a_result_without_a_payload_is_reported_in_one_call(recorder) -> None:  # type: ignore[no-untyped-def]
    """A failure (like any result without a payload) goes through Report, not a Push
    stream, on the long-lived channel."""
    servicer, address = recorder
    connection = _connect(address)
    try:
        failure = ResultHeader(Session("c1", b"s" * 32), "t1", 1, None, failure="it broke")
        assert connection.push(failure, None) is False
        assert servicer.peers["Report"] == servicer.peers["Join"]
        assert servicer.peers["Push"] == []
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
        # the refused upload's connection is closed too (in gRPC's background teardown)
        assert _wait_for(lambda: _connections_to(address) == 1)
    finally:
        connection.close()
