"""Bad results get a clear gRPC status, are dropped, and the round goes on untouched."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from helpers import ScriptedClient, run_clients, small_weights

from fedloom import TaskKind, Weights
from fedloom.messages import PROTOCOL_VERSION, JoinRequest, ResultHeader, Session
from fedloom.payload import PayloadInfo, iter_chunks, serialize
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc
from fedloom.server import Server


class RawClient:
    """Speaks the protocol by hand, to send what a well-behaved SDK never would."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.FleetStub(self.channel)
        reply = self.stub.Join(
            codec.join_request_to_proto(JoinRequest(PROTOCOL_VERSION, frozenset({"fit"}), "raw"))
        )
        self.session = codec.join_reply_from_proto(reply).session

    def pull_task(self):
        for _ in range(20):
            messages = list(
                self.stub.Pull(pb.PullRequest(session=codec.session_to_proto(self.session)))
            )
            if messages[0].WhichOneof("part") == "task":
                return codec.task_from_proto(messages[0].task)
        raise AssertionError("no task")

    def push(self, header: ResultHeader, payload: bytes | None, chunk: int = 1 << 16) -> None:
        def gen():
            yield codec.result_to_proto(header)
            if payload is not None:
                yield from codec.chunks_for_push(iter_chunks(payload, chunk))

        self.stub.Push(gen(), timeout=10)


def _fit_header(session: Session, task, delta: Weights, **overrides) -> tuple[ResultHeader, bytes]:
    payload = bytes(serialize(delta))
    fields = dict(
        num_examples=10,
        base_round=task.round - 1,
        update=PayloadInfo.describe(delta.specs(), payload),
    )
    fields.update(overrides)
    return ResultHeader(session, task.task_id, task.round, TaskKind.FIT, **fields), payload


def _zeros_like(w: Weights) -> Weights:
    return Weights({n: np.zeros_like(a) for n, a in w.items()})


def test_every_bad_result_is_refused_and_the_round_completes(server_config) -> None:
    config = server_config(
        num_rounds=1, min_clients=3, min_fit_clients=2, round_timeout_s=20.0, max_num_examples=1000
    )
    handle = Server(config, initial_weights=small_weights()).start()
    raw = RawClient(handle.address)
    honest = [ScriptedClient(seed=i, num_examples=4) for i in range(2)]
    threads = run_clients(handle.address, honest)
    task = raw.pull_task()
    good = _zeros_like(small_weights())
    nan = Weights({"w": np.full((4, 3), np.nan, np.float32), "b": np.zeros(3, np.float32)})
    wrong_name = Weights({"w": np.zeros((4, 3), np.float32), "c": np.zeros(3, np.float32)})
    wrong_shape = Weights({"w": np.zeros((3, 4), np.float32), "b": np.zeros(3, np.float32)})
    wrong_dtype = Weights({"w": np.zeros((4, 3), np.float64), "b": np.zeros(3, np.float32)})
    s = raw.session
    cases = [
        (
            "unknown task",
            _fit_header(
                s,
                task,
                good,
            ),
            {"task_id": "nope"},
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        (
            "other round",
            _fit_header(s, task, good),
            {"round": task.round + 5},
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        (
            "stale base",
            _fit_header(s, task, good, base_round=7),
            {},
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        ("wrong names", _fit_header(s, task, wrong_name), {}, grpc.StatusCode.INVALID_ARGUMENT),
        ("wrong shape", _fit_header(s, task, wrong_shape), {}, grpc.StatusCode.INVALID_ARGUMENT),
        ("wrong dtype", _fit_header(s, task, wrong_dtype), {}, grpc.StatusCode.INVALID_ARGUMENT),
        ("nan", _fit_header(s, task, nan), {}, grpc.StatusCode.INVALID_ARGUMENT),
        (
            "zero examples",
            _fit_header(s, task, good, num_examples=0),
            {},
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            "absurd examples",
            _fit_header(s, task, good, num_examples=10**9),
            {},
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            "bad session",
            _fit_header(Session(s.client_id, b"x" * 32), task, good),
            {},
            grpc.StatusCode.UNAUTHENTICATED,
        ),
    ]
    # Bad digest: the header is fine, the bytes are not (the task stays open for it).
    header, payload = _fit_header(s, task, good)
    tampered = bytearray(payload)
    tampered[0] ^= 1
    with pytest.raises(grpc.RpcError) as info:
        raw.push(header, bytes(tampered))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "digest" in info.value.details()
    # Results refused before the round sees them (an unknown task, another round, a
    # bad session) leave the task open; the first refused for what it is (its base,
    # layout, values, examples) ends it, and later ones hear that it ended.
    ended_by = ""
    for name, (header, payload), changes, code in sorted(
            cases, key=lambda c: c[3] is not grpc.StatusCode.UNAUTHENTICATED
            and c[0] not in ("unknown task", "other round")):
        if changes:
            import dataclasses

            header = dataclasses.replace(header, **changes)
        with pytest.raises(grpc.RpcError) as info:
            raw.push(header, payload)
        if ended_by:
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, name
            assert "this result is no longer needed" in info.value.details(), name
            continue
        assert info.value.code() == code, name
        assert info.value.details(), name
        if name not in ("unknown task", "other round", "bad session"):
            ended_by = name
    assert ended_by == "stale base"
    # A result for a task it was never given (another client's task id is unknown to it).
    history = handle.wait(60)
    for t in threads:
        t.join(10)
    assert history[-1].status == "ok"
    assert history[-1].num_updates == 2  # the raw client's garbage never counted
    new = handle.server.coordinator.global_weights
    sent = [c.sent[0] for c in honest]
    expected = np.mean([n["w"] - g["w"] for _, g, n in sent], axis=0)
    np.testing.assert_allclose(new["w"], expected, rtol=1e-5, atol=1e-6)


def test_retried_push_is_idempotent_and_a_different_payload_is_refused(server_config) -> None:
    config = server_config(num_rounds=1, min_clients=1, min_fit_clients=1)
    handle = Server(config, initial_weights=small_weights()).start()
    raw = RawClient(handle.address)
    task = raw.pull_task()
    delta = Weights({"w": np.ones((4, 3), np.float32), "b": np.ones(3, np.float32)})
    header, payload = _fit_header(raw.session, task, delta)
    raw.push(header, payload)
    raw.push(header, payload)  # a retry after a lost acknowledgement: accepted, once
    other = Weights({"w": np.full((4, 3), 2, np.float32), "b": np.ones(3, np.float32)})
    header2, payload2 = _fit_header(raw.session, task, other)
    with pytest.raises(grpc.RpcError) as info:
        raw.push(header2, payload2)
    assert info.value.code() in (
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    history = handle.wait(30)
    assert history[-1].num_updates == 1
    np.testing.assert_allclose(handle.server.coordinator.global_weights["w"], 1.0)
