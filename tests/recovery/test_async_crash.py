"""Asynchronous rounds: the server process killed right after it made an update durable
(before the client heard back). The same command resumes, and the step includes every
update the killed server had kept; the killed server's open tasks are refused, and
nothing is counted twice."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from fedbuff import GatedClient, fedbuff_reference, gated_clients, initial_weights
from recovery_support import CRASH_EXIT, ServerProcess, free_port, run_settings

from fedloom.server import save_weights
from fedloom.server.checkpoint import load_checkpoint
from fedloom.server.store import RunStore


def test_killed_after_keeping_an_update_the_restarted_server_steps_with_it(
        tmp_path: Path) -> None:
    port = free_port()
    settings = run_settings(
        tmp_path / "state", port, num_rounds=1, min_clients=1, min_fit_clients=1,
        fraction_evaluate=0.0,
        strategy={"name": "fedavg"},
        rounds={"mode": "async", "concurrency": 3, "buffer_size": 3, "max_staleness": 10})
    server = ServerProcess(tmp_path, settings)
    save_weights(server.weights_path, initial_weights())
    clients = [GatedClient(seed=i, num_examples=10 * (i + 1)) for i in range(3)]
    with gated_clients(f"127.0.0.1:{port}", clients):
        proc = server.start("async_update_kept:2")
        for client in clients:  # all three train version 0
            assert client.waiting.acquire(timeout=30), server.log_tail()
        clients[0].gate.release()
        assert clients[0].waiting.acquire(timeout=20), server.log_tail()  # acknowledged
        clients[1].gate.release()  # kept on disk, then the server dies
        assert server.wait(proc, 30) == CRASH_EXIT, server.log_tail()

        proc = server.start()
        assert server.wait_until_serving(proc)
        # Client 2's old task is unknown to the new server: its result is refused, and
        # it trains again; that second update completes the step.
        clients[2].gate.release()
        assert clients[2].waiting.acquire(timeout=30), server.log_tail()
        clients[2].gate.release()
        assert server.wait(proc, 30) == 0, server.log_tail()
    assert "recovered 2 acknowledged updates" in server.log_path.read_text()
    arrivals = [clients[0].arrival(0, 0), clients[1].arrival(0, 1), clients[2].arrival(1, 2)]
    assert all(a.base_version == 0 for a in arrivals)
    want = fedbuff_reference(initial_weights(), arrivals, buffer_size=3)
    state = tmp_path / "state"
    store = RunStore(state / "fedloom.db")
    try:
        rows = store.rounds(store.runs()[-1].run_id)
    finally:
        store.close()
    assert [r.round for r in rows] == [0, 1]
    got = load_checkpoint(state / rows[1].checkpoint, rows[1].sha256).weights
    for name in got:
        np.testing.assert_allclose(got[name], want[1][name], rtol=1e-5, atol=1e-6)
