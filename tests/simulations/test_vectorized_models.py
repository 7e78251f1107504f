"""`VectorizedFitter` on models other than the MLP, against `TorchClient` alone.

The fitter computes the loss outside ``vmap`` on the batched logits and steps the
optimizer over lists of tensors, so the shapes the MLP never has are checked here: a
convolution (4-d weights), a scalar parameter (FedProx's distance of a 0-d tensor), and
a frozen layer (a parameter that is not trained, passed as a constant). Expected values
come from `make_torch_client(...).fit` on the same model, as in ``test_vectorized.py``;
the tolerance is that file's (float rounding of batched products).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

from fedloom.client_sdk import FitOutput
from fedloom.simulations.fitting import FitTask
from fedloom.simulations.job import Job
from fedloom.simulations.models import initial_weights, make_torch_client
from fedloom.simulations.scenario import scenario_from_mapping
from fedloom.simulations.vectorized import VectorizedFitter

RTOL, ATOL = 1e-4, 1e-5


class ScaledConv(torch.nn.Module):
    """8x8 digits as images: a convolution, a frozen linear layer and a learnt scalar
    temperature on the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, kernel_size=3)
        self.hidden = torch.nn.Linear(4 * 6 * 6, 16)
        self.hidden.requires_grad_(False)
        self.out = torch.nn.Linear(16, 10)
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images = x.reshape(*x.shape[:-1], 1, 8, 8)
        features = torch.relu(self.conv(images)).flatten(-3)
        return self.out(torch.relu(self.hidden(features))) * self.temperature


def make_job() -> Job:
    return Job.from_scenario(scenario_from_mapping({
        "num_clients": 12, "clients_per_round": 4, "rounds": 1, "progress": False,
        "partition": {"name": "dirichlet", "alpha": 0.3, "min_size": 1},
        "client": {"batch_size": 16},
    }))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_conv_net_with_a_scalar_and_a_frozen_parameter_trains_as_alone(
        optimizer: str) -> None:
    job = make_job()
    model = ScaledConv()
    weights = initial_weights(model, seed=3)
    fitter = VectorizedFitter(model, job.clients, batch_size=16, lr=0.05, momentum=0.9,
                              optimizer=optimizer, seed=1)
    configs: list[dict[str, Any]] = [
        {"seed": 21, "local_epochs": 2, "proximal_mu": 0.5},
        {"seed": 22, "local_epochs": 1, "lr": 0.1},
        {"seed": 23, "local_epochs": 3, "proximal_mu": 0.1, "max_update_norm": 0.05},
    ]
    tasks = [FitTask(i, c) for i, c in zip((0, 5, 11), configs, strict=True)]
    results = list(fitter.fit(weights, tasks))
    for ours, task in zip(results, tasks, strict=True):
        data = job.clients[task.index]
        client = make_torch_client(data.x, data.y, batch_size=16, lr=0.05, momentum=0.9,
                                   seed=1, model=copy.deepcopy(model), optimizer=optimizer)
        expected = client.fit(weights, dict(task.config))
        assert isinstance(ours, FitOutput), ours
        assert list(ours.weights) == list(expected.weights)
        for name, value in expected.weights.items():
            np.testing.assert_allclose(ours.weights[name], value, rtol=RTOL, atol=ATOL,
                                       err_msg=name)
        np.testing.assert_array_equal(ours.weights["hidden.weight"], weights["hidden.weight"])
        assert ours.num_examples == expected.num_examples
        for key, metric in expected.metrics.items():
            assert ours.metrics[key] == pytest.approx(metric, rel=RTOL, abs=ATOL), key
    # the runs trained the scalar too
    first = results[0]
    assert isinstance(first, FitOutput)
    assert first.weights["temperature"] != weights["temperature"]
