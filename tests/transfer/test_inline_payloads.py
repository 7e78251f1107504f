"""Small payloads inside their headers (the "inline" capability), spoken by hand against a
real server: what a granted session gets and may send, what everyone else gets as
before, and each way a client can misuse it refused with its reason.

Threat model: the client is the adversary. It may claim a capability it was not
granted, put a payload where none belongs, send one larger than the limit, or one that
does not match the digest its header declares; each is refused (INVALID_ARGUMENT, the
reason named) before anything reaches the round, and the server carries on.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import grpc
import numpy as np
import pytest
from helpers import committed_models

from fedloom import TaskKind, Weights
from fedloom.config import TransferConfig
from fedloom.messages import PROTOCOL_VERSION, JoinRequest, ResultHeader, TaskHeader
from fedloom.payload import INLINE_MAX_BYTES, PayloadInfo, inline_limit, serialize
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc
from fedloom.server import Server

SMALL = Weights({"w": np.arange(12, dtype=np.float32).reshape(4, 3)})
#: 40,000 bytes: over the inline limit, one chunk at the default chunk size.
LARGE = Weights({"w": np.arange(10_000, dtype=np.float32)})


class RawClient:
    """Joins with the capabilities given and reads its Tasks stream in a thread."""

    def __init__(self, address: str, capabilities: frozenset[str]) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.FleetStub(self.channel)
        reply = codec.join_reply_from_proto(self.stub.Join(codec.join_request_to_proto(
            JoinRequest(PROTOCOL_VERSION, capabilities, "+".join(sorted(capabilities))))))
        self.granted = reply.capabilities
        self.session = reply.session
        self.messages: queue.Queue[Any] = queue.Queue()
        call = self.call = self.stub.Tasks(
            pb.PullRequest(session=codec.session_to_proto(self.session)))

        def read() -> None:
            try:
                for message in call:
                    self.messages.put(message)
            except grpc.RpcError as exc:
                self.messages.put(exc)

        threading.Thread(target=read, daemon=True).start()

    def next_message(self) -> Any:
        message = self.messages.get(timeout=10.0)
        assert not isinstance(message, grpc.RpcError), message
        return message

    def first_task(self) -> tuple[TaskHeader, pb.TaskHeader]:
        message = self.next_message()
        while message.WhichOneof("part") == "no_task":
            message = self.next_message()
        assert message.WhichOneof("part") == "task"
        return codec.task_from_proto(message.task), message.task

    def fit_result(self, task: TaskHeader, delta: Weights, **fields: Any
                   ) -> tuple[ResultHeader, bytes]:
        payload = bytes(serialize(delta))
        return ResultHeader(self.session, task.task_id, task.round, TaskKind.FIT,
                            num_examples=4, base_round=task.round - 1,
                            update=PayloadInfo.describe(delta.specs(), payload),
                            **fields), payload

    def report_inline(self, header: ResultHeader, payload: bytes) -> bool:
        """Report ``header`` with ``payload`` inside it; whether it was a duplicate."""
        reply = self.stub.Report(codec.result_to_proto(header, inline=payload), timeout=10)
        return bool(reply.duplicate)

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


def _one_update_committed(history: list[Any], state_dir: str, want: np.ndarray) -> None:
    assert (history[-1].status, history[-1].num_updates) == ("ok", 1)
    np.testing.assert_array_equal(committed_models(state_dir)[1]["w"], want)


@pytest.fixture()
def serve(server_config):  # type: ignore[no-untyped-def]
    handles = []

    def start(weights: Weights = SMALL, **overrides: Any) -> Any:
        config = server_config(**{"min_clients": 1, "min_fit_clients": 1, "num_rounds": 1,
                                  "fraction_evaluate": 0.0, "long_poll_s": 0.5, **overrides})
        handle = Server(config, initial_weights=weights).start()
        handles.append((handle, config))
        return handle, config

    yield start
    for handle, _ in handles:
        handle.stop()


def test_the_limit_is_one_chunk_at_most_and_32_kib() -> None:
    assert INLINE_MAX_BYTES == 32 * 1024
    assert inline_limit(1 << 20) == 32 * 1024
    assert inline_limit(4096) == 4096


def test_a_granted_session_gets_its_task_in_one_message_and_reports_its_update_inline(
        serve) -> None:  # type: ignore[no-untyped-def]
    handle, config = serve()
    client = RawClient(handle.address, frozenset({"fit", "inline"}))
    try:
        assert client.granted == {"fit", "inline"}
        task, proto = client.first_task()
        assert proto.inline_payload == bytes(serialize(SMALL))
        assert PayloadInfo.describe(SMALL.specs(), proto.inline_payload) == task.weights
        # No chunk follows: the stream's next message is its keep-alive.
        assert client.next_message().WhichOneof("part") == "no_task"
        delta = Weights({"w": np.full((4, 3), 0.5, np.float32)})
        assert client.report_inline(*client.fit_result(task, delta)) is False
        history = handle.wait(30)
    finally:
        client.close()
    _one_update_committed(history, config.state_dir, SMALL["w"] + 0.5)


def _chunked(client: RawClient, weights: Weights) -> None:
    """The first task's header carries no payload, and its one chunk follows."""
    task, proto = client.first_task()
    assert proto.inline_payload == b""
    chunk = client.next_message()
    assert chunk.WhichOneof("part") == "chunk"
    assert chunk.chunk.data == bytes(serialize(weights)) and task.weights.total_bytes == len(
        chunk.chunk.data)


def test_a_long_poll_pull_carries_the_payload_inside_its_header_too(serve) -> None:  # type: ignore[no-untyped-def]
    handle, _ = serve()
    channel = grpc.insecure_channel(handle.address)
    try:
        stub = pb_grpc.FleetStub(channel)
        reply = codec.join_reply_from_proto(stub.Join(codec.join_request_to_proto(
            JoinRequest(PROTOCOL_VERSION, frozenset({"fit", "inline"}), "poller"))))
        messages = list(stub.Pull(pb.PullRequest(session=codec.session_to_proto(
            reply.session)), timeout=10))
    finally:
        channel.close()
    (only,) = messages  # the header, and the call ends: no chunk
    assert only.WhichOneof("part") == "task"
    assert only.task.inline_payload == bytes(serialize(SMALL))


# (what the client asks, the server's settings, the model, what is granted)
CHUNKED = {
    "not-asked": ({"fit"}, {}, SMALL, {"fit"}),
    "server-off": ({"fit", "inline"}, {"transfer": TransferConfig(inline_payloads=False)},
                   SMALL, {"fit"}),
    "over-the-limit": ({"fit", "inline"}, {}, LARGE, {"fit", "inline"}),
}


@pytest.mark.parametrize("case", CHUNKED)
def test_otherwise_the_payload_comes_as_a_header_and_a_chunk(serve, case: str) -> None:  # type: ignore[no-untyped-def]
    """A session that did not ask, a server with inline payloads off, and a model over
    the limit even for a granted session: the task's payload follows in its chunk."""
    asked, settings, weights, granted = CHUNKED[case]
    handle, _ = serve(weights=weights, **settings)
    client = RawClient(handle.address, frozenset(asked))
    try:
        assert client.granted == granted
        _chunked(client, weights)
    finally:
        client.close()


def _refusal(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_each_misuse_is_refused_with_its_reason_and_the_round_goes_on(serve) -> None:  # type: ignore[no-untyped-def]
    handle, config = serve(weights=LARGE, min_clients=2, min_fit_clients=2)
    granted = RawClient(handle.address, frozenset({"fit", "inline"}))
    plain = RawClient(handle.address, frozenset({"fit"}))
    try:
        task, _ = granted.first_task()
        delta = Weights({"w": np.ones(10_000, np.float32)})
        header, payload = granted.fit_result(task, delta)
        # Over the limit (its layout and digest are right): send it through Push.
        assert _refusal(lambda: granted.stub.Report(
            codec.result_to_proto(header, inline=payload), timeout=10)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"an inline payload of {len(payload)} bytes is over the limit of "
            f"{INLINE_MAX_BYTES} bytes; send it through Push")
        # A payload inside a Push header.
        assert _refusal(lambda: granted.stub.Push(
            iter([codec.result_to_proto(header, inline=b"x")]), timeout=10)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "a payload inside its result header goes through Report, not Push")
        # A payload with no update header to describe it.
        failure = ResultHeader(granted.session, task.task_id, task.round, None,
                               failure="no data")
        assert _refusal(lambda: granted.stub.Report(
            codec.result_to_proto(failure, inline=b"x"), timeout=10)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "an inline payload needs the update header that describes it")
        # From a session that was not granted the capability.
        other, _ = plain.first_task()
        small, small_payload = plain.fit_result(other, Weights({"w": np.ones(4, np.float32)}))
        assert _refusal(lambda: plain.stub.Report(
            codec.result_to_proto(small, inline=small_payload), timeout=10)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "this session was not granted the 'inline' capability: send the payload through "
            "Push")
        # None of these touched a task: each client's honest update still counts.
        for client, t in ((granted, task), (plain, other)):
            h, p = client.fit_result(t, delta)
            frames = [codec.result_to_proto(h), pb.PushRequest(chunk=pb.Chunk(data=p))]
            assert client.stub.Push(iter(frames), timeout=10).duplicate is False
        history = handle.wait(30)
    finally:
        granted.close()
        plain.close()
    assert (history[-1].status, history[-1].num_updates) == ("ok", 2)
    np.testing.assert_array_equal(committed_models(config.state_dir)[1]["w"], LARGE["w"] + 1)


@pytest.mark.parametrize("tamper", ["digest", "short"])
def test_an_inline_update_that_does_not_match_its_header_is_refused_and_may_be_resent(
        serve, tamper: str) -> None:  # type: ignore[no-untyped-def]
    handle, config = serve()
    client = RawClient(handle.address, frozenset({"fit", "inline"}))
    try:
        task, _ = client.first_task()
        header, payload = client.fit_result(task, Weights({"w": np.ones((4, 3), np.float32)}))
        sent = payload[:-1] + b"\x01" if tamper == "digest" else payload[:-4]
        want = ("payload SHA-256 digest mismatch" if tamper == "digest"
                else f"stream ended after {len(sent)} of {len(payload)} payload bytes")
        assert _refusal(lambda: client.stub.Report(
            codec.result_to_proto(header, inline=sent), timeout=10)) == (
            grpc.StatusCode.INVALID_ARGUMENT, want)
        # Bytes damaged on the way fail no task (as through Push): the whole bytes count.
        assert client.report_inline(header, payload) is False
        history = handle.wait(30)
    finally:
        client.close()
    _one_update_committed(history, config.state_dir, SMALL["w"] + 1)
