"""The local engine against a hand-computed FedAvg, failures, and run_scenario's files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import fedloom.simulations
from fedloom.client_sdk import Client, EvaluateOutput, FitOutput
from fedloom.config import SelectionConfig, StrategyConfig
from fedloom.server import load_weights
from fedloom.simulations.job import Job
from fedloom.simulations.local_engine import run_local
from fedloom.simulations.plan import client_fit_config, client_infos, fit_seed
from fedloom.simulations.runner import run_scenario
from fedloom.simulations.scenario import Scenario, load_scenario
from fedloom.strategies import STRATEGIES, ClientSampler, FedAvg
from fedloom.types import Config
from fedloom.weights import Weights


class ShiftClient(Client):
    """Client i moves every weight by (i + 1) + (seed % 7) / 7 and reports i + 1 examples."""

    def __init__(self, index: int, fail: bool = False) -> None:
        self.index, self.fail = index, fail
        self.configs: list[dict] = []

    def fit(self, weights: Weights, config: Config) -> FitOutput:
        self.configs.append(dict(config))
        if self.fail:
            raise RuntimeError("boom")
        shift = (self.index + 1) + (int(config["seed"]) % 7) / 7
        new = Weights((k, (v + shift).astype(v.dtype)) for k, v in weights.items())
        return FitOutput(new, self.index + 1, {"train_loss": float(self.index)})

    def evaluate(self, weights: Weights, config: Config) -> EvaluateOutput:
        return EvaluateOutput(float(self.index), self.index + 1, {"accuracy": 0.5})


def test_local_engine_equals_hand_computed_fedavg() -> None:
    n, rounds, base_seed = 20, 3, 11
    clients = [ShiftClient(i) for i in range(n)]
    initial = Weights({"w": np.zeros(3, np.float64)})
    history = run_local(
        FedAvg(selection=SelectionConfig(fraction_fit=0.25, min_fit_clients=1,
                                         fraction_evaluate=0.1, seed=5)),
        clients.__getitem__, initial, num_clients=n, num_rounds=rounds,
        base_seed=base_seed, fit_defaults={"local_epochs": 2},
    )
    # Reference: the same seeded sampler, FedAvg by hand. Evaluation samples from a
    # generator of (seed, round): the fit draws follow one another.
    sampler, expected = ClientSampler(5), 0.0
    for r in range(1, rounds + 1):
        chosen = [int(c) for c in sampler.sample(client_infos(n), 0.25, 1)]
        shifts = [(i + 1) + (fit_seed(base_seed, i, r) % 7) / 7 for i in chosen]
        weights = [i + 1 for i in chosen]
        expected += np.dot(weights, shifts) / sum(weights)
        record = history.rounds[r]
        assert record.get("num_updates") == 5 and record.get("num_failures") == 0
        assert record.get("num_examples") == sum(weights)
        assert record.get("federated_num_examples") is not None
        for i in chosen:
            (config,) = [c for c in clients[i].configs if c["server_round"] == r]
            assert config["seed"] == fit_seed(base_seed, i, r)
            assert config["local_epochs"] == 2
    assert history.weights is not None
    np.testing.assert_allclose(history.weights["w"], expected, rtol=1e-12)
    assert [r.round for r in history.rounds] == [0, 1, 2, 3]


def test_failed_clients_are_counted_not_fatal() -> None:
    clients = [ShiftClient(i, fail=i % 2 == 0) for i in range(6)]
    history = run_local(FedAvg(), clients.__getitem__,
                        Weights({"w": np.zeros(2)}), num_clients=6, num_rounds=1)
    record = history.rounds[1]
    assert record.get("num_failures") == 3 and record.get("num_updates") == 3
    # FedAvg over clients 1, 3, 5 only (shift i + 1 + seed term, weights i + 1).
    chosen = [1, 3, 5]
    shifts = [(i + 1) + (fit_seed(0, i, 1) % 7) / 7 for i in chosen]
    expected = np.dot([2, 4, 6], shifts) / 12
    assert history.weights is not None
    np.testing.assert_allclose(history.weights["w"], expected)


def test_round_without_updates_keeps_the_model() -> None:
    clients = [ShiftClient(i, fail=True) for i in range(3)]
    initial = Weights({"w": np.ones(2)})
    history = run_local(FedAvg(), clients.__getitem__, initial, num_clients=3,
                        num_rounds=2)
    assert history.weights is not None and history.weights.allclose(initial)
    assert history.rounds[1].get("no_model_reason")


SCENARIOS = Path(fedloom.simulations.__file__).parent / "scenarios"

SMALL = Scenario(name="small", num_clients=6, clients_per_round=3, rounds=2, progress=False,
                 seed=1)


def test_run_scenario_writes_history_plot_and_checkpoint(tmp_path: Path) -> None:
    history = run_scenario(SMALL, tmp_path)
    data = json.loads((tmp_path / "history.json").read_text())
    assert data["engine"] == "local" and data["scenario"]["name"] == "small"
    assert [r["round"] for r in data["rounds"]] == [0, 1, 2]
    assert data["rounds"][2]["test_accuracy"] == history.final("test_accuracy")
    csv_lines = (tmp_path / "history.csv").read_text().splitlines()
    assert csv_lines[0].startswith("round,") and len(csv_lines) == 4
    assert (tmp_path / "history.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert history.weights is not None
    assert load_weights(tmp_path / "final.safetensors").allclose(history.weights, 0, 0)
    assert not list(tmp_path.glob(".*.tmp"))  # temp files renamed away


def test_run_scenario_is_reproducible_and_seed_sensitive() -> None:
    a, b = run_scenario(SMALL, None), run_scenario(SMALL, None)
    c = run_scenario(SMALL.replace(seed=2), None)
    assert a.weights is not None and b.weights is not None and c.weights is not None
    assert a.weights.allclose(b.weights, rtol=0, atol=0)
    assert not a.weights.allclose(c.weights, rtol=0, atol=1e-6)
    strip = [{k: v for k, v in r.metrics.items() if k != "seconds"} for r in a.rounds]
    assert strip == [{k: v for k, v in r.metrics.items() if k != "seconds"} for r in b.rounds]


def test_digits_training_improves_accuracy() -> None:
    scenario = Scenario(num_clients=10, clients_per_round=5, rounds=5, local_epochs=2,
                        progress=False)
    history = run_scenario(scenario, None)
    first, last = history.rounds[0].get("test_accuracy"), history.final("test_accuracy")
    assert last is not None and last > first + 0.4


@pytest.mark.parametrize("partition", [{"name": "dirichlet", "alpha": 0.5}, {"name": "shards"}])
def test_non_iid_partitions_run(partition: dict) -> None:
    from fedloom.simulations.scenario import PartitionSpec

    scenario = SMALL.replace(partition=PartitionSpec(**partition), rounds=1)
    assert run_scenario(scenario, None).rounds[1].get("num_updates") == 3


def test_synthetic_scenario_runs() -> None:
    from fedloom.simulations.scenario import DatasetSpec

    scenario = SMALL.replace(dataset=DatasetSpec(name="synthetic", max_samples=200), rounds=1,
                             evaluate_clients_per_round=2)
    record = run_scenario(scenario, None).rounds[1]
    assert record.get("num_updates") == 3 and record.get("federated_loss") is not None


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_registered_strategy_runs_a_round(name: str) -> None:
    scenario = Scenario(num_clients=10, clients_per_round=10, rounds=1, progress=False,
                        strategy=StrategyConfig(name))
    record = run_scenario(scenario, None).rounds[1]
    assert record.get("num_failures") == 0
    assert record.get("num_updates") == 10 or record.get("no_model_reason")


def test_strategy_client_settings_reach_the_clients() -> None:
    # FedAdam sends the client learning rate as eta_l; the run's defaults must not
    # shadow it with client.lr (TorchClient reads lr before eta_l).
    scenario = Scenario(num_clients=4, clients_per_round=2, rounds=1, progress=False,
                        strategy=StrategyConfig("fedadam", {"eta_l": 0.3}))
    job = Job.from_scenario(scenario)
    plan = job.build_strategy().configure_fit(1, job.initial_weights(), client_infos(4))
    config = client_fit_config(plan.config, base_seed=0, client_index=0, server_round=1,
                               defaults=job.fit_defaults())
    assert config["eta_l"] == 0.3 and "lr" not in config and config["local_epochs"] == 1


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.toml")), ids=lambda p: p.stem)
def test_example_scenarios_load_and_run(path: Path) -> None:
    scenario = load_scenario(path).replace(rounds=1, progress=False)
    if scenario.dataset.name == "synthetic":
        scenario = scenario.replace(local_epochs=1)
    assert run_scenario(scenario, None).rounds[1].get("num_failures") == 0
