"""Speaking the Fleet protocol step by step with the SDK's `Connection` (for tests that
need to control exactly when each client pulls and pushes)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from fedloom import TaskKind, Weights
from fedloom.client_sdk.connection import Connection
from fedloom.config import ClientConfig
from fedloom.messages import NoTask, ResultHeader, TaskHeader
from fedloom.payload import PayloadInfo, serialize


def connect(address: str, name: str, task_stream: bool = True) -> Connection:
    conn = Connection(ClientConfig(server_address=address, rpc_timeout_s=10.0, insecure=True,
                                   task_stream=task_stream))
    conn.join(name)
    return conn


def pull_task(conn: Connection) -> tuple[TaskHeader, Weights]:
    for _ in range(50):
        outcome = conn.pull()
        if not isinstance(outcome, NoTask):
            return outcome
    raise AssertionError("no task arrived")


def push_zero_update(conn: Connection, task: TaskHeader, weights: Weights) -> bool:
    assert conn.session is not None
    delta = Weights({n: np.zeros_like(a) for n, a in weights.items()})
    payload = serialize(delta)
    header = ResultHeader(
        conn.session,
        task.task_id,
        task.round,
        TaskKind.FIT,
        num_examples=5,
        base_round=task.round - 1,
        update=PayloadInfo.describe(delta.specs(), payload),
    )
    return conn.push(header, payload)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)
