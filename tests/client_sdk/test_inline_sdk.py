"""The SDK's side of the "inline" capability: it asks for it at Join (unless its transfer
config says no), reports a small update inside its result header when granted, and
checks a payload that came inside a task header as it checks chunks."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from fedloom import TaskKind, Weights
from fedloom.client_sdk._download import receive_task
from fedloom.client_sdk._watchdog import Watchdog
from fedloom.client_sdk.connection import Connection
from fedloom.config import ClientConfig, TransferConfig
from fedloom.errors import TransportError
from fedloom.messages import Capability, ResultHeader, TaskHeader
from fedloom.payload import PayloadInfo, serialize
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.server import Server

WEIGHTS = Weights({"w": np.arange(12, dtype=np.float32)})
PAYLOAD = bytes(serialize(WEIGHTS))


class Recorder:
    """Wraps a stub method and keeps the request of every call."""

    def __init__(self, method: Any) -> None:
        self.method, self.requests = method, []

    def __call__(self, request: Any, **kwargs: Any) -> Any:
        self.requests.append(request)
        return self.method(request, **kwargs)


@pytest.mark.parametrize("inline", [True, False])
def test_a_small_update_goes_inside_its_header_only_when_granted(
        server_config, inline: bool) -> None:  # type: ignore[no-untyped-def]
    handle = Server(server_config(min_clients=1, min_fit_clients=1, num_rounds=1,
                                  fraction_evaluate=0.0),
                    initial_weights=WEIGHTS).start()
    connection = Connection(ClientConfig(server_address=handle.address, insecure=True,
                                         transfer=TransferConfig(inline_payloads=inline)))
    try:
        grant = connection.join("sdk")
        assert (Capability.INLINE in grant.capabilities) is inline
        outcome = connection.pull()
        assert isinstance(outcome, tuple)
        task, weights = outcome
        np.testing.assert_array_equal(weights["w"], WEIGHTS["w"])
        report = connection._stub.Report = Recorder(connection._stub.Report)  # type: ignore[method-assign]
        push = connection._push = Recorder(connection._push)
        delta = Weights({"w": np.ones(12, np.float32)})
        payload = serialize(delta)
        result = ResultHeader(connection.session, task.task_id, task.round,  # type: ignore[arg-type]
                              TaskKind.FIT, num_examples=3, base_round=0,
                              update=PayloadInfo.describe(delta.specs(), payload))
        assert connection.push(result, payload) is False
        history = handle.wait(30)
    finally:
        connection.close()
    if inline:
        (request,) = report.requests
        assert request.result.inline_payload == bytes(payload) and push.requests == []
    else:
        assert report.requests == [] and len(push.requests) == 1
    assert (history[-1].status, history[-1].num_updates) == ("ok", 1)


def _task_message(inline: bytes) -> pb.PullResponse:
    info = PayloadInfo.describe(WEIGHTS.specs(), PAYLOAD)
    return codec.task_to_proto(TaskHeader("t1", "run-1", 1, TaskKind.FIT, {}, 10.0, info),
                               inline=inline)


def _receive(messages: list[pb.PullResponse], whole_stream: bool) -> Any:
    config = ClientConfig(server_address="127.0.0.1:1", insecure=True)
    return receive_task(iter(messages), Watchdog(), config, "run-1", whole_stream)


@pytest.mark.parametrize("whole_stream", [False, True])
def test_a_payload_inside_the_task_header_is_the_model(whole_stream: bool) -> None:
    task, weights = _receive([_task_message(PAYLOAD)], whole_stream)
    assert task.task_id == "t1"
    np.testing.assert_array_equal(weights["w"], WEIGHTS["w"])


@pytest.mark.parametrize(("messages", "reason"), [
    ([_task_message(PAYLOAD[:-1] + b"\x7f")], "payload SHA-256 digest mismatch"),
    ([_task_message(PAYLOAD[:-4])], "stream ended after 44 of 48 payload bytes"),
    ([_task_message(PAYLOAD), pb.PullResponse(chunk=pb.Chunk(offset=48, data=b"\0" * 4))],
     "payload exceeds the 48 bytes its header declares"),
], ids=["digest", "short", "chunk-after-inline"])
def test_an_inline_payload_that_does_not_match_its_header_is_refused(
        messages: list[pb.PullResponse], reason: str) -> None:
    with pytest.raises(TransportError, match=re.escape(
            f"the task's weights failed verification: {reason}") + "$"):
        _receive(messages, whole_stream=True)
