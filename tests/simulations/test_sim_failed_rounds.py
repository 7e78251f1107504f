"""A round whose aggregation raises `AggregationError` fails, is recorded with its
reason, and the run goes on from the same model: the server's rule
(`fedloom.server.plain_round`), on every engine."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
from sim_fakegrid import FakeGrid
from test_sim_async import NO_EVALUATION, PullClient, initial
from test_sim_bridge import shift_app

from fedloom.config import RoundsConfig
from fedloom.errors import AggregationError
from fedloom.simulations._records import weights_to_arrays
from fedloom.simulations.flower_strategy import FlowerStrategy
from fedloom.simulations.job import Job
from fedloom.simulations.local_async import run_local_async
from fedloom.simulations.local_engine import run_local
from fedloom.simulations.runner import make_fitter
from fedloom.simulations.scenario import scenario_from_mapping
from fedloom.simulations.speed import SpeedModel
from fedloom.strategies import FedAvg
from fedloom.types import AggregateResult, ClientUpdate
from fedloom.weights import Weights

REASON = "precondition failed: too few updates"


class FailingRounds(FedAvg):
    """FedAvg, except that the rounds in ``failing`` take every update and then raise."""

    def __init__(self, failing: set[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.failing = failing

    def aggregate_fit(self, server_round: int, current: Weights,
                      updates: Iterable[ClientUpdate]) -> AggregateResult:
        if server_round in self.failing:
            list(updates)
            raise AggregationError(REASON)
        return super().aggregate_fit(server_round, current, updates)


@pytest.mark.parametrize("engine", [
    {"name": "local"}, {"name": "local", "workers": 2}, {"name": "vectorized"}],
    ids=["local", "parallel", "vectorized"])
def test_a_failed_aggregation_is_a_failed_round_and_the_run_goes_on(
        engine: dict[str, Any]) -> None:
    job = Job.from_scenario(scenario_from_mapping({
        "num_clients": 8, "clients_per_round": 4, "rounds": 3, "progress": False,
        "engine": engine}))
    client_fn = job.client_fn()
    fitter = make_fitter(job, client_fn)
    models: list[Weights] = []
    try:
        history = run_local(
            FailingRounds({2}, selection=job.scenario.selection), client_fn,
            job.initial_weights(), num_clients=8, num_rounds=3,
            fit_defaults=job.fit_defaults(), fitter=fitter,
            evaluate_fn=lambda _r, w: models.append(w) or {})
    finally:
        fitter.close()
    assert [r.status for r in history.rounds[1:]] == ["ok", "failed", "ok"]
    failed = history.rounds[2]
    assert REASON in failed.reason
    assert (failed.num_sampled, failed.num_updates, failed.num_failures) == (4, 4, 0)
    assert models[2].allclose(models[1], rtol=0, atol=0)  # the model is unchanged ...
    assert not models[3].allclose(models[2], atol=1e-6)  # ... and the next round trains


def test_a_failed_asynchronous_step_is_a_failed_version() -> None:
    clients = [PullClient(i) for i in range(3)]
    rounds = RoundsConfig(mode="async", concurrency=3, buffer_size=1)
    history = run_local_async(
        FailingRounds({2}, selection=NO_EVALUATION), clients.__getitem__, initial(),
        num_clients=3, num_rounds=3, rounds=rounds, speed=SpeedModel([1.0, 1.5, 2.2]))
    assert [r.status for r in history.rounds[1:]] == ["ok", "failed", "ok"]
    assert REASON in history.rounds[2].reason
    assert history.rounds[2].num_updates == 1  # what came in, as the server records it


def test_a_failed_round_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    clients = [PullClient(i) for i in range(3)]
    with caplog.at_level(logging.WARNING):
        run_local(FailingRounds({2}, selection=NO_EVALUATION), clients.__getitem__,
                  initial(), num_clients=3, num_rounds=2)
    logged = [r.getMessage() for r in caplog.records if "round 2" in r.getMessage()]
    assert logged == [f"round 2 failed: {REASON}; the global model is unchanged"]


def test_the_flower_bridge_records_a_failed_aggregation_and_goes_on() -> None:
    results: list[AggregateResult] = []
    bridge = FlowerStrategy(FailingRounds({1}), min_available_nodes=3,
                            on_fit_round=lambda _r, result, _f: results.append(result))
    start = Weights({"w": np.zeros(2, np.float32)})
    bridge.start(FakeGrid(shift_app(), 3), weights_to_arrays(start), num_rounds=2)
    assert [r.weights is None for r in results] == [True, False]
    assert REASON in results[0].reason
    assert results[0].num_updates == 3  # the updates that came in


class PrivateFailingRounds(FailingRounds):
    """A stand-in private strategy: says the ε it has spent (as CentralDPStrategy does)."""

    def privacy_spent(self) -> tuple[float, float]:
        return 1.5, 1e-5


def test_a_failed_round_of_a_private_strategy_says_the_epsilon_spent_so_far() -> None:
    clients = [PullClient(i) for i in range(3)]
    history = run_local(PrivateFailingRounds({2}, selection=NO_EVALUATION),
                        clients.__getitem__, initial(), num_clients=3, num_rounds=2)
    failed = history.rounds[2]
    assert failed.status == "failed"
    assert (failed.fit["privacy_epsilon"], failed.fit["privacy_delta"]) == (1.5, 1e-5)
