"""End to end over loopback gRPC: real server, real client loops."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import numpy as np
from helpers import ScriptedClient, run_clients, small_weights

from fedloom import Weights
from fedloom.server import Server
from fedloom.server.checkpoint import load_checkpoint
from fedloom.server.store import RunStore


def test_each_round_equals_numpy_fedavg_of_pushed_updates(server_config) -> None:
    config = server_config(num_rounds=3, keep_checkpoints=10)
    handle = Server(config, initial_weights=small_weights()).start()
    clients = [ScriptedClient(seed=i, num_examples=10 * (i + 1)) for i in range(3)]
    threads = run_clients(handle.address, clients)
    history = handle.wait(60)
    for t in threads:
        t.join(10)
    assert [r.status for r in history] == ["ok", "ok", "ok"]
    store = RunStore(Path(config.state_dir) / "fedloom.db")
    run = store.runs()[-1]
    assert run.status == "finished"
    rounds = {r.round: r for r in store.rounds(run.run_id)}
    previous = small_weights()
    for server_round in (1, 2, 3):
        sent = [
            (c.num_examples, g, new) for c in clients for (r, g, new) in c.sent if r == server_round
        ]
        assert len(sent) == 3
        for _, global_seen, _ in sent:  # every client trained on the previous global model
            assert global_seen.allclose(previous, rtol=0, atol=0)
        total = sum(n for n, _, _ in sent)
        expected = Weights(
            {
                name: (
                    previous[name]
                    + sum(n * (new[name].astype(np.float64) - g[name]) for n, g, new in sent)
                    / total
                ).astype(np.float32)
                for name in previous
            }
        )
        record = rounds[server_round]
        checkpoint = load_checkpoint(Path(config.state_dir) / record.checkpoint, record.sha256)
        assert checkpoint.weights.allclose(expected, rtol=1e-5, atol=1e-5)
        previous = checkpoint.weights
    store.close()


def test_model_far_larger_than_the_message_limit(server_config) -> None:
    from fedloom.config import TransferConfig

    transfer = TransferConfig(chunk_size=64 * 1024, max_message_bytes=160 * 1024)
    big = Weights({"w": np.zeros(2_000_000, np.float32), "b": np.zeros(10, np.float32)})
    assert big.nbytes > 40 * transfer.max_message_bytes
    config = server_config(num_rounds=1, min_clients=2, min_fit_clients=2, transfer=transfer)
    handle = Server(config, initial_weights=big).start()
    clients = [ScriptedClient(seed=i, num_examples=5) for i in range(2)]
    import threading

    from fedloom.client_sdk import start_client
    from fedloom.config import ClientConfig

    cfg = ClientConfig(server_address=handle.address, transfer=transfer, insecure=True)
    threads = [
        threading.Thread(
            target=start_client,
            args=(handle.address, c),
            daemon=True,
            kwargs={"config": cfg, "handle_signals": False},
        )
        for c in clients
    ]
    for t in threads:
        t.start()
    history = handle.wait(120)
    assert history[-1].status == "ok"
    new = handle.server.coordinator.global_weights
    expected = np.mean([c.sent[0][2]["w"] for c in clients], axis=0)
    np.testing.assert_allclose(new["w"], expected, rtol=1e-5, atol=1e-5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _SteadyClient(ScriptedClient):
    """Takes 30 ms to train, so 40 rounds last over a second: a stop after round 1
    lands mid-run even when the test's thread is descheduled for a while."""

    def fit(self, weights, config):  # type: ignore[no-untyped-def]
        time.sleep(0.03)
        return super().fit(weights, config)


def test_clients_survive_a_server_restart_and_the_run_resumes(server_config) -> None:
    port = _free_port()
    config = server_config(
        address=f"127.0.0.1:{port}", num_rounds=40, min_clients=2, min_fit_clients=2
    )
    first = Server(config, initial_weights=small_weights()).start()
    clients = [_SteadyClient(seed=i, num_examples=3) for i in range(2)]
    threads = run_clients(first.address, clients)
    deadline = time.time() + 30
    while not first.server.coordinator.history and time.time() < deadline:
        time.sleep(0.01)
    first.stop()  # abrupt: the run is not finished
    first.wait(30)
    done_before = first.server.coordinator.persistence.completed_round
    assert 1 <= done_before < 40
    second = Server(config, initial_weights=small_weights()).start()
    assert second.server.coordinator.next_round == done_before + 1
    history = second.wait(60)
    for t in threads:
        t.join(15)
        assert not t.is_alive()
    assert [r.round for r in history][-1] == 40
    assert all(r.status == "ok" for r in history)
    rounds_trained = sorted({r for c in clients for (r, _, _) in c.sent})
    assert rounds_trained[-1] == 40
