"""A custom `Aggregator` whose delta does not fit the model is named, with the tensor,
before the optimizer's step (which failed with a bare KeyError or broadcast error)."""

from __future__ import annotations

import numpy as np
import pytest

from fedloom import ClientUpdate, Weights
from fedloom.strategies import Aggregator, ComposedStrategy, MeanUpdate, ServerSGD

CURRENT = Weights({"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)})


class FixedDelta(Aggregator):
    """Returns ``delta`` whatever the updates (a buggy aggregator, for the test)."""

    def __init__(self, delta: Weights) -> None:
        self.delta = delta

    def start(self, current: Weights) -> None:
        pass

    def accumulate(self, update: ClientUpdate) -> None:
        pass

    def finalize(self) -> MeanUpdate:
        return MeanUpdate(self.delta, 1.0, 1)


def _aggregate(delta: Weights) -> Weights | None:
    strategy = ComposedStrategy(FixedDelta(delta), ServerSGD())
    update = ClientUpdate("c1", CURRENT.copy(), 1, base_round=0)
    return strategy.aggregate_fit(1, CURRENT, [update]).weights


@pytest.mark.parametrize(("delta", "problem"), [
    ({"w": np.ones((2, 3))}, "tensor 'b' is missing"),
    ({"w": np.ones((2, 3)), "b": np.ones(3), "c": np.ones(1)},
     "it has a tensor 'c' the model has not"),
    ({"b": np.ones(3), "w": np.ones((2, 3))},
     "its tensors are in another order than the model's"),
    ({"w": np.ones((3, 2)), "b": np.ones(3)},
     r"tensor 'w' has shape \(3, 2\), the model's \(2, 3\)"),
])
def test_a_delta_that_does_not_fit_the_model_names_the_aggregator_and_tensor(
        delta: dict[str, np.ndarray], problem: str) -> None:
    with pytest.raises(ValueError, match=f"FixedDelta.finalize returned a delta that does not "
                       f"fit the model: {problem}"):
        _aggregate(Weights(delta))


def test_a_wider_delta_of_the_same_layout_is_applied() -> None:
    new = _aggregate(Weights({"w": np.ones((2, 3)), "b": np.full(3, 2.0)}))  # float64
    assert new is not None and new["w"].dtype == np.float32
    np.testing.assert_array_equal(new["b"], np.full(3, 2.0, np.float32))
