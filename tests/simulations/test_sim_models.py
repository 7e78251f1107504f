"""`make_mlp` and `make_torch_client`: seeded shuffling, fit reproducible from its config."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from fedloom.client_sdk import TorchClient
from fedloom.errors import ConfigError
from fedloom.simulations.datasets import load_digits
from fedloom.simulations.models import initial_weights, make_mlp, make_torch_client

DIGITS = load_digits()
X, Y = DIGITS.x_train[:200], DIGITS.y_train[:200]


def test_mlp_shape_and_parameter_count() -> None:
    model = make_mlp()
    assert model(torch.zeros(3, 64)).shape == (3, 10)
    # 64*64 + 64 + 64*10 + 10
    assert sum(p.numel() for p in model.parameters()) == 4810


def test_initial_weights_depend_only_on_the_seed() -> None:
    a = initial_weights(make_mlp(), 1)
    model = make_mlp()
    torch.manual_seed(99)
    state = torch.random.get_rng_state()
    b = initial_weights(model, 1)
    assert torch.equal(state, torch.random.get_rng_state())  # caller's RNG untouched
    assert a.allclose(b, rtol=0, atol=0)
    assert not a.allclose(initial_weights(make_mlp(), 2))


def test_fit_depends_only_on_its_config_seed() -> None:
    client = make_torch_client(X, Y, batch_size=16, seed=0)
    assert isinstance(client, TorchClient)
    start = client.get_weights()
    first = client.fit(start, {"seed": 5})
    client.fit(start, {"seed": 6})  # advances nothing that the next fit sees
    again = client.fit(start, {"seed": 5})
    fresh = make_torch_client(X, Y, batch_size=16, seed=123).fit(start, {"seed": 5})
    assert first.weights.allclose(again.weights, rtol=0, atol=0)
    assert first.weights.allclose(fresh.weights, rtol=0, atol=0)
    other = client.fit(start, {"seed": 6})
    assert not first.weights.allclose(other.weights, rtol=0, atol=1e-7)


def test_training_learns_digits() -> None:
    client = make_torch_client(
        DIGITS.x_train, DIGITS.y_train, x_val=DIGITS.x_test, y_val=DIGITS.y_test, seed=0
    )
    weights = client.get_weights()
    before = client.evaluate(weights, {})
    out = client.fit(weights, {"seed": 0, "local_epochs": 3})
    after = client.evaluate(out.weights, {})
    assert out.num_examples == len(DIGITS.y_train)
    assert after.num_examples == len(DIGITS.y_test)
    assert after.loss < before.loss and float(after.metrics["accuracy"]) > 0.85


def test_config_lr_overrides_the_constructor() -> None:
    client = make_torch_client(X, Y, lr=0.05, seed=0)
    start = client.get_weights()
    tiny = client.fit(start, {"seed": 1, "lr": 1e-9}).weights
    assert tiny.allclose(start, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"lr": 0.0}, "lr"),
        ({"x_val": np.zeros((2, 64), np.float32)}, "x_val/y_val"),
    ],
)
def test_factory_refuses_bad_arguments(kwargs: dict, setting: str) -> None:
    with pytest.raises(ConfigError) as err:
        make_torch_client(X, Y, **kwargs)
    assert err.value.setting == setting


def test_factory_refuses_mismatched_arrays() -> None:
    with pytest.raises(ConfigError):
        make_torch_client(X, Y[:-1])


def test_tensor_batches_are_what_a_data_loader_yields() -> None:
    from torch.utils.data import (
        BatchSampler,
        DataLoader,
        RandomSampler,
        SequentialSampler,
        TensorDataset,
    )

    from fedloom.simulations.models import _loader

    x, y = torch.randn(45, 3), torch.arange(45)
    for batch_size, shuffle in itertools.product((1, 8, 45, 64), (True, False)):
        ours = _loader(x, y, batch_size, torch.Generator().manual_seed(5) if shuffle else None)
        dataset = TensorDataset(x, y)
        sampler = (RandomSampler(dataset, generator=torch.Generator().manual_seed(5))
                   if shuffle else SequentialSampler(dataset))
        theirs = DataLoader(dataset, batch_size=None,
                            sampler=BatchSampler(sampler, batch_size, drop_last=False))
        assert len(ours) == len(theirs)
        for _epoch in range(3):  # the generator's state carries over, as it does for theirs
            for (xa, ya), (xb, yb) in zip(ours, theirs, strict=True):
                assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_reused_optimizer_trains_as_a_fresh_one(optimizer: str) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 64)).astype(np.float32), rng.integers(0, 10, 40)
    reused = make_torch_client(x, y, batch_size=8, optimizer=optimizer, seed=1)
    start = reused.get_weights()
    config = {"seed": 3, "local_epochs": 2}
    first = reused.fit(start, {**config, "lr": 0.2})  # leaves state and another lr behind
    again = reused.fit(start, config)
    fresh = make_torch_client(x, y, batch_size=8, optimizer=optimizer, seed=1).fit(start, config)
    assert not first.weights.allclose(again.weights)
    for name in start:
        np.testing.assert_array_equal(again.weights[name], fresh.weights[name])
    assert reused._optimizer is not None and not reused._optimizer.state  # nothing held
