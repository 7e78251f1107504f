"""`fedloom.stacked`: clients' weights as one stack, and the weighted mean folding a
stack's rows at once — checked against the same updates folded one by one and against
numpy's weighted mean."""

from __future__ import annotations

import numpy as np
import pytest

from fedloom.stacked import WeightsRow, WeightsStack
from fedloom.strategies import FedAvg, FedMedian, SelectionConfig
from fedloom.types import ClientUpdate
from fedloom.weights import Weights

RNG = np.random.default_rng(3)
CURRENT = Weights({"w": RNG.normal(size=(5, 4)).astype(np.float32),
                   "b": RNG.normal(size=4).astype(np.float32),
                   "steps": np.array([7], np.int64)})


def _stack(k: int, seed: int) -> WeightsStack:
    rng = np.random.default_rng(seed)
    return WeightsStack({
        "w": rng.normal(size=(k, 5, 4)).astype(np.float32),
        "b": rng.normal(size=(k, 4)).astype(np.float32),
        "steps": np.broadcast_to(rng.integers(0, 9, size=(1,)), (k, 1)).astype(np.int64),
    })


def test_a_stack_needs_tensors_with_one_client_axis() -> None:
    with pytest.raises(ValueError, match="at least one tensor"):
        WeightsStack({})
    with pytest.raises(ValueError, match="same leading client axis"):
        WeightsStack({"a": np.zeros((2, 3)), "b": np.zeros((3, 3))})
    with pytest.raises(ValueError, match="at least one client"):
        WeightsStack({"a": np.zeros((0, 3))})
    with pytest.raises(IndexError):
        WeightsRow(_stack(2, 0), 2)


def test_rows_are_views_and_minus_is_each_rows_difference_computed_once() -> None:
    stack = _stack(3, 1)
    row = WeightsRow(stack, 2)
    assert row.specs() == CURRENT.specs() and np.shares_memory(row["w"], stack.arrays["w"])
    delta = stack.minus(CURRENT)
    assert stack.minus(CURRENT) is delta  # cached for the same base
    for r in range(3):
        expected = Weights((k, stack.arrays[k][r]) for k in CURRENT).subtract(CURRENT)
        for name in CURRENT:
            np.testing.assert_array_equal(WeightsRow(delta, r)[name], expected[name])
    assert delta.finite_rows().tolist() == [True, True, True]
    broken = WeightsStack({**stack.arrays, "b": stack.arrays["b"].copy()})
    broken.arrays["b"][1, 2] = np.nan
    assert broken.finite_rows().tolist() == [True, False, True]
    with pytest.raises(ValueError, match="missing"):
        stack.minus(Weights({"w": CURRENT["w"]}))


def _updates(stacks: list[tuple[WeightsStack, list[int]]], plain: list[Weights]
             ) -> tuple[list[ClientUpdate], list[ClientUpdate]]:
    """The same updates twice: as rows of their stacks, and as plain `Weights`."""
    rows, copies, n = [], [], 0
    for stack, which in stacks:
        delta = stack.minus(CURRENT)
        for r in which:
            n += 1
            rows.append(ClientUpdate(f"c{n}", WeightsRow(delta, r), 3 + 5 * n, 0))
            copies.append(ClientUpdate(f"c{n}", WeightsRow(delta, r).copy(), 3 + 5 * n, 0))
    for w in plain:  # an update of another kind between the stacks
        n += 1
        update = ClientUpdate(f"c{n}", w.subtract(CURRENT), 2 * n, 0)
        rows.insert(len(rows) // 2, update)
        copies.insert(len(copies) // 2, update)
    return rows, copies


def test_the_weighted_mean_folds_rows_as_it_folds_the_same_updates_one_by_one() -> None:
    plain = [Weights((k, v[0]) for k, v in _stack(1, 9).arrays.items())]
    rows, copies = _updates([(_stack(4, 5), [0, 1, 2, 3]), (_stack(5, 6), [4, 1, 3])], plain)
    strategy = FedAvg(selection=SelectionConfig(seed=0))
    ours = strategy.aggregate_fit(1, CURRENT, rows)
    reference = FedAvg(selection=SelectionConfig(seed=0)).aggregate_fit(1, CURRENT, copies)
    assert ours.weights is not None and reference.weights is not None
    weights = np.array([u.num_examples for u in copies], np.float64)
    for name in CURRENT:
        np.testing.assert_allclose(ours.weights[name], reference.weights[name], rtol=1e-6)
        deltas = np.stack([np.asarray(u.delta[name], np.float64) for u in copies])
        mean = np.tensordot(weights / weights.sum(), deltas, axes=1)
        expected = CURRENT[name] + (np.rint(mean) if name == "steps" else mean)
        np.testing.assert_allclose(ours.weights[name], expected.astype(CURRENT[name].dtype),
                                   rtol=1e-6, atol=1e-6)
    assert ours.metrics["num_updates"] == len(copies)


def test_rows_serve_strategies_that_read_each_update() -> None:
    rows, copies = _updates([(_stack(5, 7), [0, 1, 2, 3, 4])], [])
    ours = FedMedian(selection=SelectionConfig(seed=0)).aggregate_fit(1, CURRENT, rows)
    theirs = FedMedian(selection=SelectionConfig(seed=0)).aggregate_fit(1, CURRENT, copies)
    assert ours.weights is not None and theirs.weights is not None
    for name in CURRENT:
        np.testing.assert_array_equal(ours.weights[name], theirs.weights[name])


def test_a_known_row_layout_is_checked_and_shared() -> None:
    stack = _stack(3, 1)
    again = WeightsStack(stack.arrays, row_specs=stack.row_specs)
    assert again.row_specs is stack.row_specs
    assert stack.minus(CURRENT).row_specs is stack.row_specs
    with pytest.raises(ValueError, match="names differ"):
        WeightsStack({"b": stack.arrays["b"], "w": stack.arrays["w"],
                      "steps": stack.arrays["steps"]}, row_specs=stack.row_specs)
    with pytest.raises(ValueError, match="'b': rows of float64"):
        WeightsStack({**stack.arrays, "b": stack.arrays["b"].astype(np.float64)},
                     row_specs=stack.row_specs)
    with pytest.raises(ValueError, match=r"'w': rows of float32\[4, 5\]"):
        WeightsStack({**stack.arrays, "w": np.zeros((3, 4, 5), np.float32)},
                     row_specs=stack.row_specs)
