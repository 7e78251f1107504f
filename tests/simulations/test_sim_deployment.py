"""Deployment equals simulation: one scenario through the gRPC server and the local engine.

The same deterministic scenario (digits, 5 clients, 3 sampled per round, FedAvg, 3
rounds) runs twice: on the local engine, and through the real `Server` with five real
`start_client` loops on loopback gRPC. Each deployed client joins under its partition's
name (so the seeded sampler, which orders clients by name, picks the same ones) and
trains with the seed the simulation would give it (`plan.fit_seed`). The global model
after every round must agree.

Tolerance: the server folds updates in arrival order, the local engine in plan order;
float64 sums of three float32 deltas in another order differ by a few ulps, and three
rounds of SGD carry that along, so we allow 1e-5 absolute on weights of order 0.1-1.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from helpers import run_clients  # noqa: E402

from fedloom.client_sdk import Client, EvaluateOutput, FitOutput  # noqa: E402
from fedloom.config import StrategyConfig  # noqa: E402
from fedloom.server import Server  # noqa: E402
from fedloom.server.checkpoint import load_checkpoint  # noqa: E402
from fedloom.server.store import RunStore  # noqa: E402
from fedloom.simulations.job import Job  # noqa: E402
from fedloom.simulations.local_engine import run_local  # noqa: E402
from fedloom.simulations.plan import client_fit_config, client_info  # noqa: E402
from fedloom.simulations.scenario import Scenario  # noqa: E402
from fedloom.strategies import Strategy  # noqa: E402
from fedloom.types import AggregateResult, Config  # noqa: E402
from fedloom.weights import Weights  # noqa: E402

SCENARIO = Scenario(
    name="deploy-vs-sim",
    seed=3,
    num_clients=5,
    clients_per_round=3,
    rounds=3,
    local_epochs=1,
    progress=False,
    strategy=StrategyConfig("fedavg"),
)


class PartitionClient(Client):
    """Client ``index`` of the scenario; records the rounds it trained in.

    Deployed (``deployed=True``), it adds to each fit config what the simulation's engine
    adds: the run-wide defaults and the per-(client, round) seed. Simulated, it passes
    the engine's config through untouched.
    """

    def __init__(self, job: Job, index: int, *, deployed: bool) -> None:
        self.index = index
        self.deployed = deployed
        self.inner = job.make_client(index)
        self.defaults = job.fit_defaults()
        self.base_seed = job.scenario.seed
        self.rounds: list[int] = []

    def fit(self, weights: Weights, config: Config) -> FitOutput:
        server_round = int(config["server_round"])
        self.rounds.append(server_round)
        if not self.deployed:
            return self.inner.fit(weights, config)
        sim_config = client_fit_config(
            config,
            base_seed=self.base_seed,
            client_index=self.index,
            server_round=server_round,
            defaults=self.defaults,
        )
        return self.inner.fit(weights, sim_config)

    def evaluate(self, weights: Weights, config: Config) -> EvaluateOutput:
        return self.inner.evaluate(weights, config)


class Recording:
    """Wraps a strategy and keeps the global model each round produced."""

    def __init__(self, inner: Strategy) -> None:
        self.inner = inner
        self.models: dict[int, Weights] = {}

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.inner, name)

    def aggregate_fit(self, server_round, current, updates) -> AggregateResult:  # type: ignore[no-untyped-def]
        result = self.inner.aggregate_fit(server_round, current, updates)
        assert result.weights is not None
        self.models[server_round] = result.weights.copy()
        return result


@pytest.fixture
def one_torch_thread():  # type: ignore[no-untyped-def]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_server_and_the_local_engine_give_the_same_model(
    server_config, one_torch_thread, tmp_path: Path
) -> None:
    job = Job.from_scenario(SCENARIO)
    initial = job.initial_weights()

    # Simulation: the local engine, each client its own object (as deployed ones are).
    simulated = Recording(job.build_strategy())
    sim_clients = [PartitionClient(job, i, deployed=False) for i in range(SCENARIO.num_clients)]
    run_local(
        simulated,  # type: ignore[arg-type]
        sim_clients.__getitem__,
        initial,
        num_clients=SCENARIO.num_clients,
        num_rounds=SCENARIO.rounds,
        base_seed=SCENARIO.seed,
        fit_defaults=job.fit_defaults(),
    )

    # Deployment: the same strategy settings behind the real server, real client loops.
    config = server_config(
        num_rounds=SCENARIO.rounds,
        min_clients=SCENARIO.num_clients,
        min_fit_clients=SCENARIO.clients_per_round,
        fraction_fit=SCENARIO.clients_per_round / SCENARIO.num_clients,
        fraction_evaluate=0.0,
        min_evaluate_clients=0,
        seed=SCENARIO.seed,
        keep_checkpoints=10,
    )
    handle = Server(config, initial_weights=initial, strategy=job.build_strategy()).start()
    deployed = [PartitionClient(job, i, deployed=True) for i in range(SCENARIO.num_clients)]
    threads: list[threading.Thread] = []
    for i, client in enumerate(deployed):  # named as the simulation names partitions
        threads += run_clients(handle.address, [client], name=client_info(i).name)
    history = handle.wait(120)
    for t in threads:
        t.join(15)
    assert [r.status for r in history] == ["ok"] * SCENARIO.rounds

    # The same clients were sampled each round (and not all of them: sampling counts)...
    for server_round in range(1, SCENARIO.rounds + 1):
        trained = sorted(c.index for c in deployed if server_round in c.rounds)
        assert len(trained) == SCENARIO.clients_per_round
        assert trained == sorted(c.index for c in sim_clients if server_round in c.rounds)
    # ...and every round's committed global model equals the simulated one.
    store = RunStore(Path(config.state_dir) / "fedloom.db")
    try:
        run = store.runs()[-1]
        for record in store.rounds(run.run_id):
            if record.round == 0:
                continue
            committed = load_checkpoint(Path(config.state_dir) / record.checkpoint, record.sha256)
            expected = simulated.models[record.round]
            assert committed.weights.allclose(expected, rtol=0, atol=1e-5), record.round
            # Not vacuous: each round moved the model well beyond the tolerance.
            previous = simulated.models.get(record.round - 1, initial)
            moved = max(
                float(np.abs(expected[k] - previous[k]).max()) for k in expected
            )
            assert moved > 1e-3
    finally:
        store.close()
