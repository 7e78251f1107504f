"""`LeanFitter` against `SerialFitter` over the same job's clients.

Each task's `FitOutput` must equal what the client's own `TorchClient.fit` returns, bit
for bit, whatever the fit config asks (epochs, learning rate, FedProx, clipping), how
the round is cut into chunks, and whatever ran on the shared module before (an
evaluation, another round); a run's global models must match the serial engine's
within float rounding (the rows are folded in another order).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from sim_fits import assert_same_output

from fedloom.client_sdk import Client, EvaluateOutput, FitOutput
from fedloom.client_sdk.torch_trainer import TorchClient
from fedloom.simulations.fitting import FitTask, RoundFitter, SerialFitter
from fedloom.simulations.job import Job
from fedloom.simulations.lean import LeanFitter
from fedloom.simulations.local_engine import run_local
from fedloom.simulations.scenario import scenario_from_mapping
from fedloom.stacked import WeightsRow
from fedloom.strategies import FedAvg, FedProx, SelectionConfig
from fedloom.types import Config
from fedloom.weights import Weights

SCENARIO = {"name": "lean", "num_clients": 9, "clients_per_round": 6, "rounds": 3,
            "seed": 5, "progress": False, "client": {"batch_size": 8}}


@pytest.fixture(scope="module")
def job() -> Job:
    return Job.from_scenario(scenario_from_mapping(SCENARIO))


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def shared_clients(job: Job) -> dict[int, TorchClient]:
    """The job's clients on one module, as the local runner builds them."""
    shared = job.make_model()
    return {i: job.make_client(i, model=shared) for i in range(job.scenario.num_clients)}


CONFIGS: list[dict[str, Any]] = [
    {"seed": 11, "local_epochs": 1},
    {"seed": 12, "local_epochs": 3, "lr": 0.2},
    {"seed": 13, "local_epochs": 1, "proximal_mu": 0.5},
    {"seed": 14, "local_epochs": 2, "max_update_norm": 0.05},  # clipped
    {"seed": 15, "local_epochs": 1, "max_update_norm": 1e6},  # not clipped
    {"local_epochs": 1},  # no seed: the client's generator goes on
]


@pytest.mark.parametrize("chunk_bytes", [1, 3 * 4810 * 4, 2**26])
def test_each_output_equals_the_clients_own_fit(job: Job, chunk_bytes: int) -> None:
    weights = job.initial_weights()
    tasks = [FitTask(i % job.scenario.num_clients, cfg) for i, cfg in enumerate(CONFIGS)]
    expected = list(SerialFitter(shared_clients(job).__getitem__).fit(weights, tasks))
    lean = LeanFitter(shared_clients(job).__getitem__, chunk_bytes=chunk_bytes)
    outputs = list(lean.fit(weights, tasks))
    assert len(outputs) == len(tasks)
    for actual, wanted in zip(outputs, expected, strict=True):
        assert_same_output(actual, wanted)
    clipped = outputs[3]
    assert isinstance(clipped, FitOutput) and clipped.metrics["update_norm"] > 0.05
    assert not isinstance(clipped.weights, WeightsRow)  # clipping made new weights
    assert isinstance(outputs[0], FitOutput) and isinstance(outputs[0].weights, WeightsRow)


def test_outputs_stay_right_after_the_module_evaluated_and_trained_elsewhere(job: Job) -> None:
    """The module is shared: an evaluation (eval mode, other weights) and a foreign fit
    in between must not leak into the next fit."""
    clients = shared_clients(job)
    lean = LeanFitter(clients.__getitem__)
    weights = job.initial_weights()
    tasks = [FitTask(1, {"seed": 3}), FitTask(2, {"seed": 4})]
    first = list(lean.fit(weights, tasks))
    other = Weights((k, v + 0.5) for k, v in weights.items())
    clients[0].evaluate(other, {})
    assert not clients[0].model.training
    clients[3].fit(other, {"seed": 9})
    again = list(lean.fit(weights, tasks))
    for a, b in zip(again, first, strict=True):
        assert_same_output(a, b)


def selection() -> SelectionConfig:
    return SelectionConfig(fraction_fit=0.7, min_fit_clients=2, seed=1)


@pytest.mark.parametrize("make_strategy", [
    lambda: FedAvg(selection=selection()),
    lambda: FedProx(proximal_mu=0.1, selection=selection()),
], ids=["fedavg", "fedprox"])
def test_a_run_matches_the_serial_engine_round_by_round(job: Job, make_strategy: Any) -> None:
    def models(fitter: RoundFitter, clients: dict[int, TorchClient]) -> list[Weights]:
        kept: list[Weights] = []
        run_local(make_strategy(), clients.__getitem__, job.initial_weights(),
                  num_clients=job.scenario.num_clients, num_rounds=job.scenario.rounds,
                  base_seed=job.scenario.seed, fit_defaults=job.fit_defaults(),
                  evaluate_fn=lambda _r, w: kept.append(w.copy()) or {}, fitter=fitter)
        return kept

    serial_clients, lean_clients = shared_clients(job), shared_clients(job)
    expected = models(SerialFitter(serial_clients.__getitem__), serial_clients)
    actual = models(LeanFitter(lean_clients.__getitem__), lean_clients)
    assert len(actual) == len(expected) == job.scenario.rounds + 1
    moved = 0.0
    for a, b in zip(actual, expected, strict=True):
        # float64 sums in another order, rounded to float32: a float32 ulp at most
        assert a.allclose(b, rtol=0, atol=1e-7)
        moved = max(moved, max(float(np.abs(a[k] - expected[0][k]).max()) for k in a))
    assert moved > 1e-3  # the runs trained


class NotTorch(Client):
    def fit(self, weights: Weights, config: Config) -> FitOutput:
        return FitOutput(weights, 1, {})

    def evaluate(self, weights: Weights, config: Config) -> EvaluateOutput:
        return EvaluateOutput(0.0, 1, {})


def test_failing_tasks_are_reported_in_place_and_other_clients_fit_themselves(job: Job) -> None:
    clients: dict[int, Any] = shared_clients(job)
    clients[4] = NotTorch()
    lean = LeanFitter(clients.__getitem__)
    tasks = [FitTask(1, {"seed": 1}), FitTask(2, {"seed": 2, "local_epochs": 0}),
             FitTask(4, {"seed": 4}), FitTask(3, {"seed": 3, "proximal_mu": -1}),
             FitTask(99, {"seed": 5}), FitTask(5, {"seed": 6})]
    outputs = list(lean.fit(job.initial_weights(), tasks))
    assert isinstance(outputs[1], Exception) and "local_epochs" in str(outputs[1])
    assert isinstance(outputs[2], FitOutput) and outputs[2].num_examples == 1  # its own fit
    assert isinstance(outputs[3], Exception) and "proximal_mu" in str(outputs[3])
    assert isinstance(outputs[4], KeyError)
    reference = SerialFitter(shared_clients(job).__getitem__)
    expected = list(reference.fit(job.initial_weights(), [tasks[0], tasks[5]]))
    assert_same_output(outputs[0], expected[0])
    assert_same_output(outputs[5], expected[1])


def test_weights_of_another_layout_fail_every_task_with_the_reason(job: Job) -> None:
    lean = LeanFitter(shared_clients(job).__getitem__)
    weights = job.initial_weights()
    wrong = Weights((k, v.astype(np.float64) if k == "0.bias" else v) for k, v in weights.items())
    outputs = list(lean.fit(wrong, [FitTask(1, {"seed": 1}), FitTask(2, {"seed": 2})]))
    assert all(isinstance(o, ValueError) and "0.bias" in str(o) for o in outputs)
    short = Weights((k, v) for k, v in weights.items() if k != "2.bias")
    outputs = list(lean.fit(short, [FitTask(1, {"seed": 1})]))
    assert isinstance(outputs[0], ValueError) and "missing ['2.bias']" in str(outputs[0])


class Replacing(torch.nn.Sequential):
    """The job's MLP, except that its forward pass swaps a parameter for a new tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self[2].bias = torch.nn.Parameter(self[2].bias.detach().clone())
        return super().forward(x)


def test_rows_of_a_module_whose_training_replaced_a_tensor_fail_and_others_stand(
    job: Job,
) -> None:
    clients: dict[int, Any] = shared_clients(job)
    mlp = job.make_model()
    clients[0] = job.make_client(0, model=Replacing(*mlp))
    lean = LeanFitter(clients.__getitem__)
    tasks = [FitTask(1, {"seed": 1}), FitTask(0, {"seed": 2}), FitTask(2, {"seed": 3})]
    weights = job.initial_weights()
    outputs = list(lean.fit(weights, tasks))
    assert isinstance(outputs[1], RuntimeError)
    assert "'2.bias'" in str(outputs[1]) and "in place" in str(outputs[1])
    expected = list(SerialFitter(shared_clients(job).__getitem__).fit(
        weights, [tasks[0], tasks[2]]))
    assert_same_output(outputs[0], expected[0])  # the shared module's rows stand
    assert_same_output(outputs[2], expected[1])
    again = list(lean.fit(weights, [FitTask(0, {"seed": 2})]))  # walked afresh, fails again
    assert isinstance(again[0], RuntimeError)


def test_settings_are_checked_and_close_drops_the_round(job: Job) -> None:
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="chunk_bytes"):
            LeanFitter(shared_clients(job).__getitem__, chunk_bytes=bad)
    lean = LeanFitter(shared_clients(job).__getitem__)
    weights = job.initial_weights()
    list(lean.fit(weights, [FitTask(1, {"seed": 1})]))
    assert lean._round is weights and lean._starts
    lean.close()
    assert lean._round is None and not lean._starts


def test_the_torch_copy_path_of_accelerators_gives_the_same_outputs(
    job: Job, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tensors off the CPU have no numpy views: weights then move with torch's copies
    (the path a CUDA module takes), exercised here by withholding the views."""
    from fedloom.simulations import lean

    real_init = lean._Start.__init__

    def without_views(self: Any, module: torch.nn.Module, weights: Weights) -> None:
        real_init(self, module, weights)
        self.views = None

    monkeypatch.setattr(lean._Start, "__init__", without_views)
    weights = job.initial_weights()
    tasks = [FitTask(i, cfg) for i, cfg in enumerate(CONFIGS[:4])]
    expected = list(SerialFitter(shared_clients(job).__getitem__).fit(weights, tasks))
    outputs = list(LeanFitter(shared_clients(job).__getitem__).fit(weights, tasks))
    for actual, wanted in zip(outputs, expected, strict=True):
        assert_same_output(actual, wanted)
