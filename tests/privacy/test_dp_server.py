"""Central DP on a real server over loopback gRPC: the budget ends the run, and a resumed
run continues the same ledger.

Every client trains every round (``fraction_fit = 1``, ``min_clients`` = the number of
clients), so each round is a plain Gaussian on sensitivity 2C (``sampling = "fixed"``
with m = n, replace-one): the expected ε of k rounds is dp-accounting's, computed here.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import pytest
from helpers import ScriptedClient, run_clients, small_weights
from test_accountant import reference_epsilon

from fedloom import ServerConfig, Weights
from fedloom.privacy import PrivacyConfig, RoundEvent
from fedloom.server import Server
from fedloom.server.metrics import ServerMetrics
from fedloom.server.store import RunStore

NUM_CLIENTS = 3
Z = 2.0


def _epsilon(rounds: int) -> float:
    return reference_epsilon([RoundEvent(Z, NUM_CLIENTS, NUM_CLIENTS)] * rounds, "fixed")


def _target(allowed: int) -> float:
    """A budget between the ε of ``allowed`` and of ``allowed + 1`` rounds."""
    return (_epsilon(allowed) + _epsilon(allowed + 1)) / 2


def _privacy(allowed: int) -> PrivacyConfig:
    return PrivacyConfig(mode="central", noise_multiplier=Z, clip_norm=1.0,
                         target_epsilon=_target(allowed), sampling="fixed")


def _store_rounds(state_dir: str) -> tuple[str, list[Any]]:
    store = RunStore(Path(state_dir) / "fedloom.db")
    try:
        run = store.runs()[-1]
        return run.status, [r for r in store.rounds(run.run_id) if r.round > 0]
    finally:
        store.close()


def _run(config: ServerConfig, clients: list[ScriptedClient] | None = None
         ) -> tuple[list[Any], list[ScriptedClient]]:
    """Run ``config``'s server with ``clients`` (default: NUM_CLIENTS scripted ones) to the
    end; its history and the clients (each told the run is over)."""
    handle = Server(config, initial_weights=small_weights()).start()
    clients = clients or [ScriptedClient(seed=i, num_examples=5) for i in range(NUM_CLIENTS)]
    threads = run_clients(handle.address, clients)
    history = handle.wait(60)
    for t in threads:
        t.join(15)
        assert not t.is_alive()  # told the run is finished
    return history, clients


def test_the_budget_ends_the_run_cleanly(server_config) -> None:  # type: ignore[no-untyped-def]
    allowed = 3
    config = server_config(num_rounds=8, min_clients=NUM_CLIENTS, min_fit_clients=NUM_CLIENTS,
                           fraction_evaluate=0.0, privacy=_privacy(allowed))
    handle = Server(config, initial_weights=small_weights()).start()
    clients = [ScriptedClient(seed=i, num_examples=5) for i in range(NUM_CLIENTS)]
    threads = run_clients(handle.address, clients)
    history = handle.wait(60)
    for t in threads:
        t.join(15)
        assert not t.is_alive()  # told the run is finished
    rounds = [r for r in history if r.round > 0]
    assert [r.round for r in rounds] == [1, 2, 3]
    assert all(r.status == "ok" for r in rounds)
    epsilons = [r.fit["privacy_epsilon"] for r in rounds]
    for k, epsilon in enumerate(epsilons, start=1):
        assert epsilon == pytest.approx(_epsilon(k), rel=1e-9)
    assert epsilons == sorted(epsilons) and epsilons[-1] <= _target(allowed)
    assert _epsilon(allowed + 1) > _target(allowed)
    # No client trained past the budget.
    assert {r for c in clients for (r, _, _) in c.sent} == {1, 2, 3}
    coordinator = handle.server.coordinator
    assert coordinator is not None and "privacy budget" in coordinator.stopped_reason
    assert coordinator.finished.is_set()
    status, stored = _store_rounds(config.state_dir)
    assert status == "finished" and [r.round for r in stored] == [1, 2, 3]
    gauge = ServerMetrics.registry.get_sample_value("fedloom_privacy_epsilon")
    assert gauge == pytest.approx(epsilons[-1], rel=1e-12)
    # `fedloom runs RUN` shows the epsilon spent by each round
    from fedloom.server.run_report import open_store, rounds_table

    store = open_store(config.state_dir)
    try:
        table = rounds_table(store, store.runs()[-1]).splitlines()
    finally:
        store.close()
    header = table[1].split()  # table[0] is the title line
    assert header[-1] == "EPSILON"
    shown = [float(row.split()[-1]) for row in table[2:]]
    assert shown == pytest.approx(epsilons, abs=5e-4)


class GatedClient(ScriptedClient):
    """Trains at once, except in ``gate_round``: there it waits for ``gate``."""

    def __init__(self, seed: int, gate: threading.Event, gate_round: int) -> None:
        super().__init__(seed, num_examples=5)
        self.gate, self.gate_round = gate, gate_round
        self.waiting = threading.Event()

    def fit(self, weights: Weights, config):  # type: ignore[no-untyped-def]
        if int(config["server_round"]) == self.gate_round and not self.gate.is_set():
            self.waiting.set()
            self.gate.wait(30)
        return super().fit(weights, config)


def test_a_resumed_run_continues_the_same_ledger(tmp_path: Path) -> None:
    with socket.socket() as s:  # the restarted server listens where the clients reconnect
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    allowed = 5

    def config() -> ServerConfig:
        return ServerConfig(
            address=f"127.0.0.1:{port}", num_rounds=10, min_clients=NUM_CLIENTS,
            min_fit_clients=NUM_CLIENTS, fraction_evaluate=0.0,
            state_dir=str(tmp_path / "state"), progress=False, round_timeout_s=30.0,
            long_poll_s=2.0, heartbeat_interval_s=0.5, client_timeout_s=5.0, insecure=True,
            privacy=_privacy(allowed))

    gate = threading.Event()
    clients = [GatedClient(i, gate, gate_round=3) for i in range(NUM_CLIENTS)]
    first = Server(config(), initial_weights=small_weights()).start()
    threads = run_clients(first.address, clients)
    # Rounds 1 and 2 commit; round 3 is held in the clients' fit. Stop there.
    assert all(c.waiting.wait(30) for c in clients)
    first.stop()
    first.wait(30)
    status, stored = _store_rounds(str(tmp_path / "state"))
    assert status == "running" and [r.round for r in stored] == [1, 2]
    gate.set()

    second = Server(config(), initial_weights=small_weights()).start()
    assert second.server.coordinator is not None
    assert second.server.coordinator.next_round == 3
    history = second.wait(60)
    for t in threads:
        t.join(15)
        assert not t.is_alive()
    # The history holds rounds 1 and 2 (stored) and 3..5, run after the resume, whose
    # epsilons compose all rounds: the ledger held rounds 1 and 2 already.
    rounds = [r for r in history if r.round > 0]
    assert [r.round for r in rounds] == [1, 2, 3, 4, 5]
    for r in rounds:
        assert r.fit["privacy_epsilon"] == pytest.approx(_epsilon(r.round), rel=1e-9)
    gauge = ServerMetrics.registry.get_sample_value("fedloom_privacy_epsilon")
    assert gauge == pytest.approx(_epsilon(allowed), rel=1e-9)
    status, stored = _store_rounds(str(tmp_path / "state"))
    assert status == "finished" and [r.round for r in stored] == [1, 2, 3, 4, 5]
    assert "privacy budget" in second.server.coordinator.stopped_reason
    # Clients trained round 3 (twice: once for the stopped server), never round 6.
    assert max(r for c in clients for (r, _, _) in c.sent) == allowed


class _FailsInRound(ScriptedClient):
    """Trains, except in round ``failing``, where its fit raises."""

    def __init__(self, seed: int, failing: int) -> None:
        super().__init__(seed=seed, num_examples=5)
        self.failing = failing

    def fit(self, weights, config):  # type: ignore[no-untyped-def]
        if config.get("server_round") == self.failing:
            raise RuntimeError("out of memory")
        return super().fit(weights, config)


def test_a_failed_round_still_says_the_epsilon_spent_so_far(server_config) -> None:  # type: ignore[no-untyped-def]
    """Every committed round carries ε spent so far, a failed one too: a distributed-DP
    round whose unmasked sum is then refused has spent budget, and the last round of
    a run must never understate it. Here round 2 fails before any release (central DP
    charges only a released mean), so its ε is round 1's; the next round goes on."""
    config = server_config(num_rounds=3, min_clients=NUM_CLIENTS, min_fit_clients=NUM_CLIENTS,
                           fraction_evaluate=0.0,
                           privacy=PrivacyConfig(mode="central", noise_multiplier=Z,
                                                 clip_norm=1.0, sampling="fixed"))
    history, _ = _run(config, [_FailsInRound(0, failing=2)] + [
        ScriptedClient(seed=i, num_examples=5) for i in range(1, NUM_CLIENTS)])
    rounds = [r for r in history if r.round > 0]
    assert [r.status for r in rounds] == ["ok", "failed", "ok"]
    epsilons = [r.fit.get("privacy_epsilon") for r in rounds]
    assert epsilons == pytest.approx([_epsilon(1), _epsilon(1), _epsilon(2)], rel=1e-9)
    _, stored = _store_rounds(config.state_dir)  # and so in the run store (fedloom runs)
    assert stored[1].metrics["fit"]["privacy_epsilon"] == pytest.approx(_epsilon(1))


def test_rounds_too_small_for_adaptive_clipping_are_not_run_and_the_server_carries_on(
        server_config, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    """3 clients a round cannot carry adaptive clipping's split at z = 2 with the
    default count noise (it needs more than 20): each round is not run, says why, and
    the server finishes the run instead of ending at round 1 with an error."""
    config = server_config(num_rounds=2, min_clients=NUM_CLIENTS, min_fit_clients=NUM_CLIENTS,
                           fraction_evaluate=0.0,
                           privacy=PrivacyConfig(mode="central", noise_multiplier=Z,
                                                 clip_norm=1.0, sampling="fixed",
                                                 clipping="adaptive"))
    history, clients = _run(config)
    rounds = [r for r in history if r.round > 0]
    assert [r.status for r in rounds] == ["failed", "failed"]
    assert all(r.reason.startswith("not run: adaptive clipping needs") for r in rounds)
    assert all(c.sent == [] for c in clients)  # nobody trained
    assert [r.fit["privacy_epsilon"] for r in rounds] == [0.0, 0.0]


def test_a_budget_that_allows_no_round_says_what_to_change(
        server_config, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    config = server_config(num_rounds=3, min_clients=NUM_CLIENTS, min_fit_clients=NUM_CLIENTS,
                           fraction_evaluate=0.0,
                           privacy=PrivacyConfig(mode="central", noise_multiplier=0.5,
                                                 clip_norm=1.0, sampling="fixed",
                                                 target_epsilon=0.1))
    history, _ = _run(config)
    assert [r.round for r in history if r.round > 0] == []
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("the budget allows no round of this run" in m
               and "raise privacy.noise_multiplier" in m for m in errors)
