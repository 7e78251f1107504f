"""Clients validate what the server sends: a hostile or broken server earns a
`TransportError` (the runner reconnects) or a refusal, never a crash or a bad model."""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from helpers import fake_fleet, fake_fleet_connection
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from property_budget import examples

from fedloom import Weights
from fedloom.client_sdk.connection import Connection, ResultRefusedError
from fedloom.errors import TransportError
from fedloom.messages import PROTOCOL_VERSION, JoinReply, NoTask, Session, TaskHeader
from fedloom.payload import PayloadInfo, iter_chunks, serialize
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc
from fedloom.types import TaskKind

WEIGHTS = Weights({"w": np.arange(40, dtype=np.float32), "b": np.ones(3, np.float32)})
PAYLOAD = bytes(serialize(WEIGHTS))


class HostileServer(pb_grpc.FleetServicer):
    """Answers Join, and Pull or Tasks, with whatever the test sets."""

    def __init__(self) -> None:
        self.join_reply = _join_reply()
        self.pull: list[pb.PullResponse] = []

    def Join(self, request: Any, context: Any) -> pb.JoinResponse:
        return self.join_reply

    def Pull(self, request: Any, context: Any) -> Iterator[pb.PullResponse]:
        yield from self.pull

    def Tasks(self, request: Any, context: Any) -> Iterator[pb.PullResponse]:
        yield from self.pull

    def Heartbeat(self, request: Any, context: Any) -> pb.HeartbeatResponse:
        return pb.HeartbeatResponse(interval_s=5.0)

    def Leave(self, request: Any, context: Any) -> pb.LeaveResponse:
        return pb.LeaveResponse()

    def Push(self, request_iterator: Any, context: Any) -> pb.PushResponse:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "this fake server takes no results")
        raise AssertionError  # abort raises


def _join_reply(**changes: Any) -> pb.JoinResponse:
    reply = JoinReply(Session("c1", b"s" * 32), PROTOCOL_VERSION, frozenset({"fit"}), "run-1",
                      5.0, 2.0, 1024, 64 * 1024, 1 << 20)  # fmt: skip
    message = codec.join_reply_to_proto(reply)
    for key, value in changes.items():
        setattr(message, key, value)
    return message


def _task(run_id: str = "run-1", payload: bytes = PAYLOAD, **info: Any) -> pb.PullResponse:
    described = PayloadInfo.describe(WEIGHTS.specs(), payload)
    header = TaskHeader("t1", run_id, 3, TaskKind.FIT, {"server_round": 3}, 10.0, described)
    message = codec.task_to_proto(header)
    for key, value in info.items():
        setattr(message.task.weights, key, value)
    return message


@pytest.fixture(scope="module")
def hostile():  # type: ignore[no-untyped-def]
    servicer = HostileServer()
    with fake_fleet(servicer) as address:
        yield servicer, address


def _connect(address: str, task_stream: bool = True) -> Connection:
    return fake_fleet_connection(address, 5.0, task_stream=task_stream)


def test_a_join_reply_in_another_protocol_or_out_of_range_is_refused(hostile) -> None:  # type: ignore[no-untyped-def]
    servicer, address = hostile
    for bad in (
        _join_reply(protocol_version=PROTOCOL_VERSION + 1),
        _join_reply(long_poll_s=float("nan")),
        _join_reply(chunk_size=0),
        _join_reply(run_id="run\n2"),
        # A server that would have its clients call it in a tight loop, or send their
        # updates in 1-byte messages; or chunks the client's messages cannot carry (a
        # TransportError: retried, not the end of the client's process).
        _join_reply(heartbeat_interval_s=1e-6),
        _join_reply(long_poll_s=0.01),
        _join_reply(chunk_size=1),
        _join_reply(chunk_size=60 * 1024, max_message_bytes=1 << 20),
    ):
        servicer.join_reply = bad
        connection = _connect(address)
        with pytest.raises(TransportError):
            connection.join("me")
        connection.close()
    servicer.join_reply = _join_reply()


def _pull(servicer: HostileServer, address: str, parts: list[pb.PullResponse],
          task_stream: bool = True) -> Any:
    servicer.pull = parts
    connection = _connect(address, task_stream)
    try:
        connection.join("me")
        return connection.pull()
    finally:
        connection.close()


@pytest.mark.parametrize("task_stream", [True, False], ids=["tasks-stream", "pull"])
def test_a_good_task_passes_and_hostile_tasks_are_refused(hostile, task_stream: bool) -> None:  # type: ignore[no-untyped-def]
    servicer, address = hostile
    chunks = [
        pb.PullResponse(chunk=pb.Chunk(offset=o, data=d)) for o, d in iter_chunks(PAYLOAD, 50)
    ]
    task, weights = _pull(servicer, address, [_task(), *chunks], task_stream)
    assert task.round == 3 and weights.allclose(WEIGHTS, rtol=0)
    nan_payload = bytes(
        serialize(Weights({"w": np.full(40, np.nan, np.float32), "b": np.ones(3, np.float32)}))
    )
    nan_chunks = [
        pb.PullResponse(chunk=pb.Chunk(offset=o, data=d)) for o, d in iter_chunks(nan_payload, 50)
    ]
    cases = {
        "another run": [_task(run_id="run-2"), *chunks],
        "chunks out of order": [_task(), *reversed(chunks)],
        "a chunk missing": [_task(), *chunks[:-1]],
        "a byte altered": [_task(sha256=hashlib.sha256(b"other").digest()), *chunks],
        "NaN weights": [_task(payload=nan_payload), *nan_chunks],
        "a second header": [_task(), _task(), *chunks],
        "chunks only": chunks,
        "nothing": [],
        "round 0": [_round_0(), *chunks],
    }
    for name, parts in cases.items():
        with pytest.raises(TransportError):
            _pull(servicer, address, parts, task_stream)
            pytest.fail(f"accepted a task with {name}")
    # A model bigger than this client accepts is refused before it is downloaded.
    with pytest.raises(ResultRefusedError):
        _pull(servicer, address, [_big_task()], task_stream)


def _round_0() -> pb.PullResponse:
    message = _task()
    message.task.round = 0
    return message


def _big_task() -> pb.PullResponse:
    message = _task()
    spec = message.task.weights.tensors[0]
    del spec.shape[:]
    spec.shape.append(10_000)
    message.task.weights.total_bytes = 40_000 + 12
    return message


@settings(max_examples=examples(25), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(st.lists(st.binary(max_size=60), max_size=6))
def test_random_task_streams_never_crash_the_client(hostile, blobs) -> None:  # type: ignore[no-untyped-def]
    servicer, address = hostile
    parts = []
    for blob in blobs:
        try:
            parts.append(pb.PullResponse.FromString(blob))
        except Exception:
            parts.append(pb.PullResponse(chunk=pb.Chunk(offset=0, data=blob)))
    for task_stream in (True, False):
        with contextlib.suppress(TransportError, ResultRefusedError):  # refused: fine
            _pull(servicer, address, [_task(), *parts], task_stream)


class _Refusing(HostileServer):
    """Accepts every Join, then answers the task stream with ``code`` and ``details``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__()
        self.code, self.details, self.joins = code, details, 0

    def Join(self, request: Any, context: Any) -> pb.JoinResponse:
        self.joins += 1
        return self.join_reply

    def Tasks(self, request: Any, context: Any) -> Iterator[pb.PullResponse]:
        context.abort(self.code, self.details)
        yield from ()  # abort raises


def test_a_server_that_accepts_every_join_and_refuses_every_call_is_backed_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # UNAUTHENTICATED means "join again"; from a server that says it to every call, the
    # client must not loop without a pause, nor past max_reconnect_attempts.
    from fedloom.client_sdk import runner, start_client
    from fedloom.config import ClientConfig

    caps: list[float] = []

    class Recorded(runner.Backoff):
        def next_delay(self) -> float:
            caps.append(min(self.max_s, self.initial_s * 2.0**self.attempt))
            return super().next_delay()

    monkeypatch.setattr(runner, "Backoff", Recorded)
    servicer = _Refusing(grpc.StatusCode.UNAUTHENTICATED, "who are you?")
    with fake_fleet(servicer) as address:
        config = ClientConfig(server_address=address, rpc_timeout_s=5.0, insecure=True,
                              reconnect_initial_s=0.01, reconnect_max_s=0.04,
                              max_reconnect_attempts=3)
        with pytest.raises(TransportError, match="gave up after 3 reconnect attempts"):
            start_client(address, _Idle(), config=config, handle_signals=False)
    assert servicer.joins == 4
    assert caps == [0.01, 0.02, 0.04]  # a pause before each join again, growing


def test_a_servers_status_details_reach_the_log_as_one_short_line() -> None:
    # 2,000 characters: over the client's cap, under gRPC's 8 KiB metadata limit.
    forged = "nope\n2026-01-01 00:00:00 INFO fedloom.client: round 7: trained" + "x" * 2_000
    servicer = _Refusing(grpc.StatusCode.FAILED_PRECONDITION, forged)
    with fake_fleet(servicer) as address:
        connection = _connect(address)
        try:
            connection.join("me")
            with pytest.raises(ResultRefusedError) as refused:
                connection.pull()
        finally:
            connection.close()
    message = str(refused.value)
    assert "\n" not in message and "\\n2026-01-01" in message
    assert len(message) < 700 and message.endswith("(cut)")


class _Idle:
    """A client that is never asked for anything (the fake server gives no task)."""

    def fit(self, weights: Any, config: Any) -> Any:
        raise AssertionError("no task expected")

    def evaluate(self, weights: Any, config: Any) -> Any:
        raise AssertionError("no task expected")


def test_a_model_the_device_cannot_hold_fails_the_task_not_the_client(
        hostile, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from fedloom.client_sdk import _download

    def no_memory(self: Any, size: int) -> None:
        raise MemoryError

    monkeypatch.setattr(_download.BufferSink, "__init__", no_memory)
    servicer, address = hostile
    with pytest.raises(ResultRefusedError, match="not enough memory for a model of"):
        _pull(servicer, address, [_task()])


class _Restarting(HostileServer):
    """Each session's first Pull is answered (no task yet); its second says the session
    is unknown, as a restarted server would; after ``sessions`` joins the run is over."""

    def __init__(self, sessions: int) -> None:
        super().__init__()
        self.sessions, self.joins, self.pulls = sessions, 0, 0

    def Join(self, request: Any, context: Any) -> pb.JoinResponse:
        self.joins, self.pulls = self.joins + 1, 0
        return self.join_reply

    def Pull(self, request: Any, context: Any) -> Iterator[pb.PullResponse]:
        self.pulls += 1
        if self.joins > self.sessions:
            yield codec.no_task_to_proto(NoTask(0.0, run_finished=True))
        elif self.pulls == 1:
            yield codec.no_task_to_proto(NoTask(0.0))
        else:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown session")


def test_a_session_that_served_and_then_expired_is_joined_again_not_counted() -> None:
    # A server restart: the session worked, then the new process does not know it. Even
    # with max_reconnect_attempts = 0 the client joins again (a failure is a join that
    # never served, as in the test above).
    from fedloom.client_sdk import start_client
    from fedloom.config import ClientConfig

    servicer = _Restarting(sessions=3)
    with fake_fleet(servicer) as address:
        config = ClientConfig(server_address=address, rpc_timeout_s=5.0, insecure=True,
                              reconnect_initial_s=0.01, reconnect_max_s=0.02,
                              max_reconnect_attempts=0, task_stream=False)
        stats = start_client(address, _Idle(), config=config, handle_signals=False)
    assert stats.run_finished and servicer.joins == 4 and stats.reconnects == 3


class _Dripping(HostileServer):
    """Sends a task's header, then its weights a few bytes at a time, each in time to
    keep the client's idle watchdog quiet."""

    def Tasks(self, request: Any, context: Any) -> Iterator[pb.PullResponse]:
        yield _task()
        for offset, data in iter_chunks(PAYLOAD, 8):
            time.sleep(0.05)
            yield pb.PullResponse(chunk=pb.Chunk(offset=offset, data=data))


def test_a_server_that_drips_a_task_cannot_hold_the_call_past_its_allowance() -> None:
    # rpc_timeout_s bounds the wait between chunks; the download as a whole may take
    # rpc_timeout_s plus 1 s per 16 KiB: this payload of ~200 bytes in 8-byte chunks
    # every 0.05 s would take 1.3 s, past the 0.3 s (+ 12 ms) it is allowed.
    servicer = _Dripping()
    with fake_fleet(servicer) as address:
        connection = fake_fleet_connection(address, 0.3)
        try:
            connection.join("me")
            started = time.monotonic()
            with pytest.raises(TransportError, match=r"did not arrive within 0\.3 s .*slower "
                                                     r"than 16 KiB/s"):
                connection.pull()
            assert time.monotonic() - started < 1.0
        finally:
            connection.close()
