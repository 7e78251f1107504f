"""A server that stops (signal, cancel, crash) has not finished the run: the clients
waiting on it must reconnect to the restarted server, not leave.

Regression test for the flaky ``test_clients_survive_a_server_restart_and_the_run_resumes``:
the coordinator used to set its "finished" event on *any* exit from ``run()``, so a
client long-polling at the moment of a stop was told ``run_finished`` and left for
good; the restarted server then waited forever for ``min_clients``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from outage import RefusingListener
from recovery_support import DeterministicClient, free_port, initial_weights

from fedloom import ServerConfig
from fedloom.client_sdk import ClientStats, start_client
from fedloom.config import ClientConfig
from fedloom.server import Server


def _config(tmp_path: Path, port: int, **overrides: object) -> ServerConfig:
    settings: dict = dict(
        address=f"127.0.0.1:{port}",
        num_rounds=1,
        min_clients=2,  # one client: no round starts, it long-polls
        min_fit_clients=1,
        fraction_evaluate=0.0,
        state_dir=str(tmp_path / "state"),
        progress=False,
        long_poll_s=5.0,
        heartbeat_interval_s=0.5,
        client_timeout_s=10.0,
        insecure=True,
    )
    settings.update(overrides)
    return ServerConfig(**settings)


def test_a_client_long_polling_through_a_stop_reconnects_and_finishes(tmp_path: Path) -> None:
    port = free_port()
    first = Server(_config(tmp_path, port), initial_weights=initial_weights()).start()
    client = DeterministicClient(seed=0, num_examples=1)
    outcome: dict[str, ClientStats] = {}
    config = ClientConfig(
        server_address=first.address,
        reconnect_initial_s=0.05,
        reconnect_max_s=0.3,
        insecure=True,
    )

    def run() -> None:
        outcome["stats"] = start_client(first.address, client, config=config, handle_signals=False)

    coordinator = first.server.coordinator
    assert coordinator is not None
    polling = threading.Event()
    real_pull = coordinator.pull

    async def pull(*args: Any, **kwargs: Any) -> Any:
        polling.set()  # set on the server's loop; the stop below runs there after it
        return await real_pull(*args, **kwargs)

    coordinator.pull = pull  # type: ignore[method-assign]
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert polling.wait(10), "the client never long-polled"
    first.stop()  # the client is inside its long-poll
    first.wait(10)
    assert not coordinator.finished.is_set()
    # A client told the run is over leaves (one Leave, then no more calls); one that
    # was not keeps trying to join again: its attempts reach the stand-in on the port.
    down = RefusingListener(port)
    try:
        joins = down.wait_for(3, timeout_s=10)
    finally:
        down.close()
    assert joins and thread.is_alive(), f"the client left a run that is not finished: {outcome}"
    # Restarted with one client enough, the run goes on and really finishes.
    second = Server(_config(tmp_path, port, min_clients=1), initial_weights=initial_weights())
    history = second.start().wait(30)
    thread.join(10)
    assert [r.status for r in history] == ["ok"]
    assert outcome["stats"].run_finished and outcome["stats"].fits == 1
    assert client.rounds == [1]


def test_a_stop_while_a_round_is_evaluated_returns_the_committed_round(
        tmp_path: Path) -> None:
    # The round is committed before its evaluation: a stop during the evaluation leaves
    # it committed, and the history the server hands back says so (evaluation pending).
    from recovery_support import NUM_ROUNDS, ClientPool, run_settings, server_config

    entered, release = threading.Event(), threading.Event()

    def evaluate(server_round: int, weights: Any) -> tuple[float, dict[str, float]]:
        if server_round == 2:
            entered.set()
            release.wait(30)
        return 0.0, {"round": float(server_round)}

    config = server_config(run_settings(tmp_path / "state", free_port()))
    handle = Server(config, initial_weights=initial_weights(), evaluate_fn=evaluate).start()
    pool = ClientPool(handle.address)
    try:
        assert entered.wait(30)
        handle.stop()
        history = handle.wait(30)
    finally:
        release.set()
        pool.stop.set()
    assert [r.round for r in history if r.round > 0] == [1, 2] and NUM_ROUNDS > 2
    assert not history[-2].evaluation_pending and history[-2].server == {
        "loss": 0.0, "round": 1.0}
    assert history[-1].evaluation_pending and history[-1].status == "ok"
