"""The Tasks stream hands a client each of its tasks once, in turn, on one call; Report
takes a result without a payload in one message. Spoken by hand against a real server,
so every rule is checked from the wire."""

from __future__ import annotations

import gc
import inspect
import queue
import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest

from fedloom import TaskKind, Weights
from fedloom.messages import PROTOCOL_VERSION, JoinRequest, ResultHeader, TaskHeader
from fedloom.payload import PayloadInfo, iter_chunks, serialize
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc
from fedloom.server import Server

WEIGHTS = Weights({"w": np.arange(12, dtype=np.float32).reshape(4, 3)})


class StreamClient:
    """Joins, then reads its Tasks stream in a thread; the test takes messages as they
    come (`next_message`)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.FleetStub(self.channel)
        reply = self.stub.Join(codec.join_request_to_proto(
            JoinRequest(PROTOCOL_VERSION, frozenset({"fit"}), "streamer")))
        self.session = codec.join_reply_from_proto(reply).session
        self.session_proto = codec.session_to_proto(self.session)
        self.messages: queue.Queue[Any] = queue.Queue()
        self.call: Any = None

    def open_stream(self) -> None:
        self.call = self.stub.Tasks(pb.PullRequest(session=self.session_proto))
        call, messages = self.call, self.messages

        def read() -> None:
            try:
                for message in call:
                    messages.put(message)
                messages.put("end")
            except grpc.RpcError as exc:
                messages.put(exc)

        threading.Thread(target=read, daemon=True).start()

    def next_message(self, timeout_s: float = 10.0) -> Any:
        return self.messages.get(timeout=timeout_s)

    def next_task(self, timeout_s: float = 10.0) -> TaskHeader:
        """The next task's header, its chunks read and checked to add up."""
        deadline = time.monotonic() + timeout_s
        while True:
            message = self.next_message(max(0.01, deadline - time.monotonic()))
            assert not isinstance(message, (str, grpc.RpcError)), message
            if message.WhichOneof("part") == "task":
                break
            assert message.WhichOneof("part") == "no_task"
        task = codec.task_from_proto(message.task)
        received = 0
        while received < task.weights.total_bytes:
            chunk = self.next_message()
            assert chunk.WhichOneof("part") == "chunk"
            received += len(chunk.chunk.data)
        assert received == task.weights.total_bytes
        return task

    def answer(self, task: TaskHeader) -> None:
        """Push a zero update for a fit task."""
        delta = Weights({"w": np.zeros((4, 3), np.float32)})
        payload = bytes(serialize(delta))
        header = ResultHeader(self.session, task.task_id, task.round, TaskKind.FIT,
                              num_examples=1, base_round=task.round - 1,
                              update=PayloadInfo.describe(delta.specs(), payload))

        def messages() -> Any:
            yield codec.result_to_proto(header)
            yield from codec.chunks_for_push(iter_chunks(payload, 1 << 16))

        self.stub.Push(messages(), timeout=10)

    def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
        self.channel.close()


@pytest.fixture()
def serve(server_config):  # type: ignore[no-untyped-def]
    handles = []

    def start(**overrides: Any) -> Any:
        config = server_config(**{"min_clients": 1, "min_fit_clients": 1, **overrides})
        handle = Server(config, initial_weights=WEIGHTS).start()
        handles.append(handle)
        return handle

    yield start
    for handle in handles:
        handle.stop()


def test_each_task_comes_once_and_the_next_follows_on_the_same_stream(serve) -> None:  # type: ignore[no-untyped-def]
    handle = serve(num_rounds=3, long_poll_s=0.5)
    client = StreamClient(handle.address)
    try:
        client.open_stream()
        first = client.next_task()
        assert first.round == 1 and first.kind is TaskKind.FIT
        # Unanswered, it is not sent again on this stream: only keep-alives come.
        for _ in range(2):
            message = client.next_message(timeout_s=3.0)
            assert message.WhichOneof("part") == "no_task"
            assert not message.no_task.run_finished
        client.answer(first)
        second = client.next_task()
        assert second.round == 2 and second.task_id != first.task_id
        client.answer(second)
        third = client.next_task()
        assert third.round == 3
        client.answer(third)
        while True:  # the run ends: a NoTask that says so, then the stream closes
            message = client.next_message()
            assert not isinstance(message, (str, grpc.RpcError)), message
            assert message.WhichOneof("part") == "no_task"
            if message.no_task.run_finished:
                break
        assert client.next_message() == "end"
        assert [r.status for r in handle.wait(10) if r.round >= 1] == ["ok"] * 3
    finally:
        client.close()


def test_a_broken_stream_ends_the_session_and_its_task(serve) -> None:  # type: ignore[no-untyped-def]
    """A client whose task stream breaks is gone (its process died, or its connection
    is cut): its session ends at once and its task fails, so no round waits for it; it
    joins again as a new session and takes part in the next round."""
    handle = serve(num_rounds=2)
    client = StreamClient(handle.address)
    fresh = None
    try:
        client.open_stream()
        first = client.next_task()
        client.call.cancel()  # the stream broke before the client answered
        deadline = time.monotonic() + 10
        while True:  # the server notices the cancel on its own schedule
            try:
                client.stub.Heartbeat(pb.HeartbeatRequest(session=client.session_proto),
                                      timeout=5)
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.UNAUTHENTICATED
                assert "join again" in (exc.details() or "")
                break
            assert time.monotonic() < deadline, "the session outlived its stream"
            time.sleep(0.02)
        fresh = StreamClient(handle.address)  # joins again: a new session
        fresh.open_stream()
        task = fresh.next_task()
        assert task.round == first.round + 1  # round 1 failed without waiting for it
        fresh.answer(task)
        statuses = [r.status for r in handle.wait(10) if r.round >= 1]
        assert statuses == ["failed", "ok"]
    finally:
        client.close()
        if fresh is not None:
            fresh.close()


def test_report_takes_a_result_without_a_payload_and_refuses_one_with(serve) -> None:  # type: ignore[no-untyped-def]
    handle = serve(num_rounds=1, min_clients=2, min_fit_clients=2)
    client, other = StreamClient(handle.address), StreamClient(handle.address)
    try:
        client.open_stream()
        task = client.next_task()  # the other client's task stays open: the round too
        with_update = ResultHeader(
            client.session, task.task_id, task.round, TaskKind.FIT, num_examples=1,
            base_round=0, update=PayloadInfo.describe(WEIGHTS.specs(), bytes(serialize(WEIGHTS))))
        with pytest.raises(grpc.RpcError) as refused:
            client.stub.Report(codec.result_to_proto(with_update), timeout=10)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "goes through Push" in (refused.value.details() or "")
        chunk_only = pb.PushRequest(chunk=pb.Chunk(offset=0, data=b"x"))
        with pytest.raises(grpc.RpcError) as refused:
            client.stub.Report(chunk_only, timeout=10)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        failure = ResultHeader(client.session, task.task_id, task.round, None,
                               failure="no data today")
        assert not client.stub.Report(codec.result_to_proto(failure), timeout=10).duplicate
        # taken: the task is closed, so the same failure again is refused as stale
        with pytest.raises(grpc.RpcError) as refused:
            client.stub.Report(codec.result_to_proto(failure), timeout=10)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "client failure: no data today" in (refused.value.details() or "")
    finally:
        client.close()
        other.close()


def test_a_stream_for_an_unknown_session_is_refused(serve) -> None:  # type: ignore[no-untyped-def]
    handle = serve(num_rounds=1)
    client = StreamClient(handle.address)
    try:
        stranger = pb.Session(client_id=client.session.client_id, secret=b"x" * 32)
        with pytest.raises(grpc.RpcError) as refused:
            list(client.stub.Tasks(pb.PullRequest(session=stranger), timeout=10))
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    finally:
        client.close()


def test_a_waiting_stream_keeps_no_model_alive(serve) -> None:  # type: ignore[no-untyped-def]
    """Between tasks, a stream holds no reference to the task it sent: a long-lived
    stream per client would otherwise keep each round's model alive into the next round
    (found by benchmarks/transfer.py: one model more at the server's peak)."""
    handle = serve(num_rounds=1)
    coordinator = handle.server.coordinator
    assert coordinator is not None
    waiting = threading.Event()
    real_pull = coordinator.pull

    async def pull(record: Any, sent: str | None = None) -> Any:
        if sent is not None:  # the stream asks for the task after the one it sent
            waiting.set()
        return await real_pull(record, sent)

    coordinator.pull = pull  # type: ignore[method-assign]
    client = StreamClient(handle.address)
    try:
        client.open_stream()
        client.next_task()  # sent; the stream now waits for the next one
        assert waiting.wait(10), "the stream did not go on to wait for a next task"
        payload = handle.server.coordinator.model.payload  # the model the stream wrote
        assert len(payload) > 0
        assert _coroutines_holding(payload) == []
    finally:
        client.close()


def _coroutines_holding(target: object) -> list[str]:
    """Coroutines whose locals hold ``target``, directly or in a tuple or list."""
    found, seen = [], {id(target)}
    level = [target]
    for _ in range(3):
        nxt = []
        for obj in level:
            for referrer in gc.get_referrers(obj):
                if id(referrer) in seen or referrer is level:
                    continue
                seen.add(id(referrer))
                if inspect.iscoroutine(referrer):
                    found.append(referrer.__qualname__)
                elif isinstance(referrer, tuple | list):
                    nxt.append(referrer)
        level = nxt
    return found
