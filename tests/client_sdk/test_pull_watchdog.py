"""A task download that goes silent is cut by the connection's watchdog, which is one
thread per connection, reused from one task to the next and stopped when the connection
closes: on the Tasks stream (the default) and with one Pull per task alike."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers import fake_fleet, fake_fleet_connection

from fedloom import Weights
from fedloom.client_sdk.connection import Connection
from fedloom.errors import TransportError
from fedloom.messages import PROTOCOL_VERSION, JoinReply, Session, TaskHeader
from fedloom.payload import PayloadInfo, iter_chunks, serialize
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc
from fedloom.types import TaskKind

WEIGHTS = Weights({"w": np.arange(600, dtype=np.float32)})
PAYLOAD = bytes(serialize(WEIGHTS))  # 2400 bytes: three chunks of 1024
RPC_TIMEOUT_S = 1.0


class StallingServer(pb_grpc.FleetServicer):
    """Sends tasks; a task whose entry in ``plan`` is True (or any task once the plan is
    used up) stalls after its first chunk until the client gives up (or ``stall_s``)."""

    def __init__(self) -> None:
        self.plan: list[bool] = []
        self.stall_s = 8.0

    def Join(self, request: Any, context: Any) -> pb.JoinResponse:
        reply = JoinReply(Session("c1", b"s" * 32), PROTOCOL_VERSION, frozenset({"fit"}),
                          "run-1", 5.0, 1.0, 1024, 64 * 1024, 1 << 20)  # fmt: skip
        return codec.join_reply_to_proto(reply)

    def _task(self, context: Any) -> Iterator[pb.PullResponse]:
        stall = self.plan.pop(0) if self.plan else True
        info = PayloadInfo.describe(WEIGHTS.specs(), PAYLOAD)
        yield codec.task_to_proto(TaskHeader("t1", "run-1", 1, TaskKind.FIT, {}, 10.0, info))
        for i, (offset, data) in enumerate(iter_chunks(PAYLOAD, 1024)):
            if i == 1 and stall:
                deadline = time.monotonic() + self.stall_s
                while context.is_active() and time.monotonic() < deadline:
                    time.sleep(0.05)
                return
            yield pb.PullResponse(chunk=pb.Chunk(offset=offset, data=data))

    def Pull(self, request: Any, context: Any) -> Iterator[pb.PullResponse]:
        yield from self._task(context)

    def Tasks(self, request: Any, context: Any) -> Iterator[pb.PullResponse]:
        while context.is_active():
            stalls = not self.plan or self.plan[0]
            yield from self._task(context)
            if stalls:
                return


@pytest.fixture()
def stalling():  # type: ignore[no-untyped-def]
    servicer = StallingServer()
    with fake_fleet(servicer) as address:
        yield servicer, address


def _connect(address: str, task_stream: bool) -> Connection:
    connection = fake_fleet_connection(address, RPC_TIMEOUT_S, task_stream=task_stream)
    connection.join("c1")
    return connection


def _watchdogs() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "fedloom-watchdog"]


@pytest.mark.parametrize("task_stream", [True, False], ids=["tasks-stream", "pull"])
def test_a_silent_download_is_cut_after_the_rpc_timeout(  # type: ignore[no-untyped-def]
    stalling, task_stream: bool
) -> None:
    servicer, address = stalling
    servicer.plan = [True]
    connection = _connect(address, task_stream)
    try:
        started = time.monotonic()
        with pytest.raises(TransportError, match="stopped sending"):
            connection.pull()
        waited = time.monotonic() - started
        # cut after RPC_TIMEOUT_S without a chunk (checked every 0.25 s), long before
        # the server would have gone on
        assert RPC_TIMEOUT_S <= waited < RPC_TIMEOUT_S + 1.5
    finally:
        connection.close()


@pytest.mark.parametrize("task_stream", [True, False], ids=["tasks-stream", "pull"])
def test_one_watchdog_thread_serves_every_task_and_stops_on_close(  # type: ignore[no-untyped-def]
    stalling, task_stream: bool
) -> None:
    servicer, address = stalling
    # Threads by identity: another test's watchdog may end while this one runs.
    before = set(_watchdogs())
    servicer.plan = [False, False, False, True]
    connection = _connect(address, task_stream)
    try:
        for _ in range(3):  # whole tasks: the watchdog must not fire between them
            task, weights = connection.pull()  # type: ignore[misc]
            assert task.task_id == "t1"
            np.testing.assert_array_equal(weights["w"], WEIGHTS["w"])
            time.sleep(RPC_TIMEOUT_S + 0.3)  # "training": nothing is read meanwhile
        with pytest.raises(TransportError, match="stopped sending"):
            connection.pull()
        ours = set(_watchdogs()) - before
        assert len(ours) == 1
    finally:
        connection.close()
    deadline = time.monotonic() + 2.0
    while ours & set(_watchdogs()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not ours & set(_watchdogs())


def test_a_cut_task_stream_is_reopened_by_the_next_pull(stalling) -> None:  # type: ignore[no-untyped-def]
    """After the watchdog cut the Tasks stream, the next pull opens a new one (and gets
    the next task) instead of reading the dead call again."""
    servicer, address = stalling
    servicer.plan = [True, False]
    connection = _connect(address, task_stream=True)
    try:
        with pytest.raises(TransportError, match="stopped sending"):
            connection.pull()
        task, weights = connection.pull()  # type: ignore[misc]
        assert task.task_id == "t1"
        np.testing.assert_array_equal(weights["w"], WEIGHTS["w"])
    finally:
        connection.close()
