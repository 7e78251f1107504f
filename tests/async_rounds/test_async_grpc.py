"""Asynchronous rounds over real gRPC, with real client loops.

The clients' fits wait for the test to release them, so the order in which updates
arrive is the test's script, not the scheduler's; the model versions the server
commits must equal FedBuff's rule in numpy over that order (the server killed mid-buffer:
tests/recovery/test_async_crash.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from fedbuff import (
    Arrival,
    GatedClient,
    committed_versions,
    fedbuff_reference,
    gated_clients,
    initial_weights,
)

from fedloom.config import RoundsConfig
from fedloom.server import Server


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _assert_versions(state: Path, want: list[dict[str, np.ndarray]]) -> None:
    got = committed_versions(state)
    assert sorted(got) == list(range(len(want)))
    for version, weights in got.items():
        for name in weights:
            np.testing.assert_allclose(weights[name], want[version][name], rtol=1e-5,
                                       atol=1e-6, err_msg=f"version {version} {name}")


def test_real_clients_over_grpc_give_numpy_fedbuff_versions(server_config) -> None:  # type: ignore[no-untyped-def]
    config = server_config(
        num_rounds=3, min_clients=3, min_fit_clients=1, fraction_evaluate=0.0,
        keep_checkpoints=10,
        rounds=RoundsConfig(mode="async", concurrency=3, buffer_size=2, max_staleness=10))
    handle = Server(config, initial_weights=initial_weights()).start()
    clients = [GatedClient(seed=i, num_examples=10 * (i + 1)) for i in range(3)]
    coordinator = handle.server.coordinator
    assert coordinator is not None
    arrivals: list[Arrival] = []
    answered = [0, 0, 0]
    with gated_clients(handle.address, clients):
        for i, index in enumerate([0, 1, 2, 0, 2, 1]):
            client = clients[index]
            assert client.waiting.acquire(timeout=20), f"client {index} got no task"
            client.gate.release()
            _until(lambda n=i + 1: coordinator.driver.num_accepted == n,  # type: ignore[attr-defined,misc]
                   f"update {i + 1}")
            arrivals.append(client.arrival(answered[index], index))
            answered[index] += 1
            if i % 2 == 1:  # a step: let it commit before the next arrival
                version = (i + 1) // 2
                _until(lambda v=version: coordinator.persistence.completed_round >= v,  # type: ignore[misc]
                       f"version {version}")
        history = handle.wait(30)
    assert [r.num_updates for r in history] == [2, 2, 2]
    want = fedbuff_reference(initial_weights(), arrivals, buffer_size=2)
    # Every task carried the version it claimed: what a client received is that version.
    for index, client in enumerate(clients):
        for server_round, received, _ in client.calls[:answered[index]]:
            for name in received:
                np.testing.assert_allclose(received[name], want[server_round - 1][name],
                                           rtol=1e-5, atol=1e-6)
    assert any(a.base_version < (i // 2) for i, a in enumerate(arrivals))  # stale ones
    _assert_versions(Path(config.state_dir), want)
