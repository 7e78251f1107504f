"""A result is bound to the client, run, round and task nonce it was issued for: only
that client may answer, a retry after a lost acknowledgement is accepted once (even
after the round closed), a different payload for a used nonce is refused, and a nonce
from before a restart means nothing to the restarted server.

(Wrong round, stale base round, bad session and bad payloads are covered in
tests/test_hostile_input.py.)"""

from __future__ import annotations

import socket
import time

import grpc
import numpy as np
import pytest
from helpers import small_weights
from security_support import MakeConfig, coordinator

from fedloom import TaskKind, Weights
from fedloom.client_sdk.connection import Connection, ResultRefusedError, SessionExpiredError
from fedloom.config import ClientConfig
from fedloom.messages import ResultHeader, Session, TaskHeader
from fedloom.payload import PayloadInfo, serialize
from fedloom.server import Server


def _connect(address: str) -> Connection:
    return Connection(ClientConfig(server_address=address, insecure=True, rpc_timeout_s=10.0))


def _pull_task(connection: Connection) -> TaskHeader:
    for _ in range(20):
        outcome = connection.pull()
        if isinstance(outcome, tuple):
            return outcome[0]
    raise AssertionError("no task")


def _fit(session: Session, task: TaskHeader, value: float) -> tuple[ResultHeader, memoryview]:
    delta = Weights({n: np.full(a.shape, value, a.dtype) for n, a in small_weights().items()})
    payload = serialize(delta)
    header = ResultHeader(
        session, task.task_id, task.round, TaskKind.FIT, num_examples=4,
        base_round=task.round - 1, update=PayloadInfo.describe(delta.specs(), payload),
    )
    return header, payload


def test_only_the_client_a_task_was_issued_to_may_answer_it(server_config: MakeConfig) -> None:
    config = server_config(num_rounds=1, min_clients=2, min_fit_clients=2, fraction_evaluate=0.0)
    handle = Server(config, initial_weights=small_weights()).start()
    a, b = _connect(handle.address), _connect(handle.address)
    try:
        a.join("a")
        b.join("b")
        task_a, task_b = _pull_task(a), _pull_task(b)
        assert task_a.task_id != task_b.task_id
        assert a.session is not None and b.session is not None
        with pytest.raises(ResultRefusedError) as info:
            a.push(*_fit(a.session, task_b, 9.0))  # a answers b's task
        assert info.value.code is grpc.StatusCode.PERMISSION_DENIED
        assert a.push(*_fit(a.session, task_a, 1.0)) is False
        assert b.push(*_fit(b.session, task_b, 3.0)) is False
        history = handle.wait(30)
    finally:
        a.close()
        b.close()
    assert history[-1].num_updates == 2
    np.testing.assert_allclose(coordinator(handle).global_weights["w"], 2.0)  # (1+3)/2


def test_a_retry_after_the_round_closed_is_accepted_once(server_config: MakeConfig) -> None:
    config = server_config(num_rounds=2, min_clients=1, min_fit_clients=1, fraction_evaluate=0.0)
    handle = Server(config, initial_weights=small_weights()).start()
    client = _connect(handle.address)
    try:
        client.join("a")
        assert client.session is not None
        task = _pull_task(client)
        result = _fit(client.session, task, 1.0)
        assert client.push(*result) is False
        rounds = coordinator(handle).history
        deadline = time.time() + 20
        while not rounds and time.time() < deadline:
            time.sleep(0.01)
        assert rounds[0].round == 1  # round 1 has closed
        assert client.push(*result) is True  # the acknowledgement was "lost": duplicate
        with pytest.raises(ResultRefusedError) as info:
            client.push(*_fit(client.session, task, 5.0))  # another payload, same nonce
        assert info.value.code is grpc.StatusCode.ALREADY_EXISTS
        second = _pull_task(client)
        assert second.round == 2 and second.task_id != task.task_id
        client.push(*_fit(client.session, second, 0.0))
        history = handle.wait(30)
    finally:
        client.close()
    assert [r.num_updates for r in history] == [1, 1]
    np.testing.assert_allclose(coordinator(handle).global_weights["w"], 1.0)  # once


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_nonce_from_before_a_restart_is_refused(server_config: MakeConfig) -> None:
    config = server_config(
        address=f"127.0.0.1:{_free_port()}", num_rounds=3, min_clients=1, min_fit_clients=1
    )
    first = Server(config, initial_weights=small_weights()).start()
    old = _connect(first.address)
    try:
        old.join("a")
        assert old.session is not None
        task = _pull_task(old)
        result = _fit(old.session, task, 1.0)
    finally:
        first.stop()
        first.wait(30)
    second = Server(config, initial_weights=small_weights()).start()
    new = _connect(second.address)
    try:
        assert coordinator(second).run_id == coordinator(first).run_id  # resumed
        with pytest.raises(SessionExpiredError):  # the old session died with the server
            old.push(*result)
        new.join("a")
        assert new.session is not None
        with pytest.raises(ResultRefusedError) as info:  # the old nonce under a new session
            new.push(*_fit(new.session, task, 1.0))
        assert info.value.code is grpc.StatusCode.FAILED_PRECONDITION
    finally:
        old.close()
        new.close()
        second.stop()
        second.wait(30)
