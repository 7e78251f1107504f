"""ServerSGD's in-place step writes the new weights over the mean delta it is given up.

It must give exactly the values of the ordinary step (one rounding of ``w + lr * d`` in
the tensor's dtype), reuse the delta's buffers for float tensors of the model's dtype,
and fall back to new arrays for everything else (integers, other dtypes, read-only
deltas). FedAvg's own mean hands its fresh arrays over (`MeanUpdate.owned`).
"""

from __future__ import annotations

import numpy as np
import pytest

from fedloom import ClientUpdate, Weights
from fedloom.strategies import FedAvg, ServerSGD, WeightedMeanAggregator


def model(rng: np.random.Generator) -> tuple[Weights, Weights]:
    current = Weights({
        "f32": rng.normal(size=(4, 5)).astype(np.float32),
        "f16": rng.normal(size=7).astype(np.float16),
        "f64": rng.normal(size=3),
        "steps": np.array(9, np.int64),
        "scalar": np.array(1.5, np.float32),
    })
    delta = Weights({
        "f32": rng.normal(size=(4, 5)).astype(np.float32),
        "f16": rng.normal(size=7),  # float64 delta of a float16 tensor: a new array
        "f64": rng.normal(size=3),
        "steps": np.array(2.6),
        "scalar": np.array(-0.25, np.float32),
    })
    return current, delta


@pytest.mark.parametrize("lr", [1.0, 0.3])
def test_in_place_step_equals_step_and_reuses_the_delta(lr: float) -> None:
    rng = np.random.default_rng(4)
    current, delta = model(rng)
    want = ServerSGD(lr).step(current, Weights({k: v.copy() for k, v in delta.items()}))
    buffers = {k: v for k, v in delta.items()}
    got = ServerSGD(lr).step_in_place(current, delta)
    for name, arr in want.items():
        assert got[name].dtype == arr.dtype == current[name].dtype, name
        np.testing.assert_array_equal(got[name], arr, err_msg=name)
    assert got["f32"] is buffers["f32"] and got["f64"] is buffers["f64"]
    assert got["scalar"] is buffers["scalar"]
    assert got["f16"] is not buffers["f16"] and got["steps"] is not buffers["steps"]


def test_a_read_only_delta_is_not_written() -> None:
    rng = np.random.default_rng(5)
    current, delta = model(rng)
    frozen = delta["f32"]
    frozen.flags.writeable = False
    before = frozen.copy()
    got = ServerSGD().step_in_place(current, delta)
    np.testing.assert_array_equal(frozen, before)
    np.testing.assert_array_equal(got["f32"], current["f32"] + before)


def test_fedavg_hands_its_fresh_mean_to_the_optimizer() -> None:
    rng = np.random.default_rng(6)
    current = Weights({"w": rng.normal(size=50).astype(np.float32)})
    updates = [ClientUpdate(f"c{i}", Weights({"w": rng.normal(size=50).astype(np.float32)}),
                            3 + i, 0) for i in range(4)]
    aggregator = WeightedMeanAggregator()
    aggregator.start(current)
    for u in updates:
        aggregator.accumulate(u)
    assert aggregator.finalize().owned
    result = FedAvg().aggregate_fit(1, current, updates)
    assert result.weights is not None
    mean = sum(u.num_examples * u.delta["w"].astype(np.float64) for u in updates) / sum(
        u.num_examples for u in updates)
    np.testing.assert_allclose(result.weights["w"], current["w"] + mean.astype(np.float32),
                               rtol=1e-6, atol=1e-7)
    for u in updates:  # the clients' deltas are never written
        assert not np.shares_memory(result.weights["w"], u.delta["w"])
