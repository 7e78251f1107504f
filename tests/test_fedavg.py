"""FedAvg against a numpy reference and against Flower's own aggregation."""

from __future__ import annotations

import numpy as np
import pytest

from fedloom import ClientUpdate, RoundAbortedError, Weights
from fedloom.config import SelectionConfig
from fedloom.strategies import FedAvg


def _updates(seed: int, n: int) -> tuple[Weights, list[ClientUpdate]]:
    rng = np.random.default_rng(seed)
    current = Weights(
        {
            "a": rng.normal(size=(5, 3)).astype(np.float32),
            "b": rng.normal(size=(7,)).astype(np.float32),
            "steps": np.array(10, np.int64),
        }
    )
    updates = [
        ClientUpdate(
            f"c{i}",
            Weights(
                {
                    "a": rng.normal(size=(5, 3)).astype(np.float32),
                    "b": rng.normal(size=(7,)).astype(np.float32),
                    "steps": np.array(int(rng.integers(0, 5)), np.int64),
                }
            ),
            int(rng.integers(1, 100)),
            0,
        )
        for i in range(n)
    ]
    return current, updates


@pytest.mark.parametrize("seed", range(5))
def test_fedavg_matches_numpy_weighted_mean(seed: int) -> None:
    current, updates = _updates(seed, 6)
    result = FedAvg().aggregate_fit(1, current, iter(updates))
    n = np.array([u.num_examples for u in updates], dtype=np.float64)
    for name in ("a", "b"):
        stack = np.stack([u.delta[name].astype(np.float64) for u in updates])
        expected = current[name] + np.tensordot(n / n.sum(), stack, axes=1)
        np.testing.assert_allclose(result.weights[name], expected, rtol=1e-6, atol=1e-6)
        assert result.weights[name].dtype == np.float32
    # Integer rule: mean delta rounded half to even, added in the tensor's dtype.
    mean_steps = sum(u.num_examples * int(u.delta["steps"]) for u in updates) / n.sum()
    assert result.weights["steps"] == 10 + np.rint(mean_steps)
    assert result.weights["steps"].dtype == np.int64
    assert result.metrics["num_examples"] == int(n.sum())


def test_fedavg_matches_flower_aggregate_arrayrecords() -> None:
    pytest.importorskip("flwr")
    from flwr.app import ArrayRecord, MetricRecord, RecordDict
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    current, updates = _updates(42, 8)
    records = [
        RecordDict(
            {
                "arrays": ArrayRecord([current["a"] + u.delta["a"], current["b"] + u.delta["b"]]),
                "metrics": MetricRecord({"num-examples": u.num_examples}),
            }
        )
        for u in updates
    ]
    flower = aggregate_arrayrecords(records, "num-examples").to_numpy_ndarrays()
    float_only = Weights({"a": current["a"], "b": current["b"]})
    ours = FedAvg().aggregate_fit(
        1,
        float_only,
        [
            ClientUpdate(
                u.client_id, Weights({"a": u.delta["a"], "b": u.delta["b"]}), u.num_examples, 0
            )
            for u in updates
        ],
    )
    np.testing.assert_allclose(ours.weights["a"], flower[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours.weights["b"], flower[1], rtol=1e-5, atol=1e-6)


def test_aborted_stream_leaves_strategy_state_unchanged() -> None:
    current, updates = _updates(1, 3)
    strategy = FedAvg(selection=SelectionConfig(seed=3))
    before = strategy.state_dict()

    def stream():
        yield updates[0]
        raise RoundAbortedError("deadline")

    with pytest.raises(RoundAbortedError):
        strategy.aggregate_fit(1, current, stream())
    assert strategy.state_dict() == before
    # And the aggregator is usable again afterwards.
    assert strategy.aggregate_fit(2, current, updates).weights is not None


def test_streaming_aggregate_holds_no_update() -> None:
    """The streaming mean keeps sums, not updates: memory is flat in the client count.

    No in-memory update outlives its ``accumulate`` call. (Spooled updates wait, as file
    references, until a group of them is folded: tests/transfer covers that path.)
    """
    import weakref

    current, updates = _updates(2, 4)
    arrays = [weakref.ref(u.delta[name]) for u in updates for name in u.delta]
    strategy = FedAvg()
    strategy.aggregator.start(current)
    while updates:
        strategy.aggregator.accumulate(updates.pop())
    assert all(ref() is None for ref in arrays)
    held = vars(strategy.aggregator)
    assert set(held["_sums"]) == {"a", "b", "steps"}
    assert held["_waiting"] == []


def test_layout_mismatch_is_refused() -> None:
    current, updates = _updates(3, 2)
    bad = ClientUpdate("x", Weights({"a": np.zeros((5, 3), np.float32)}), 1, 0)
    with pytest.raises(ValueError, match="missing"):
        FedAvg().aggregate_fit(1, current, [updates[0], bad])


def test_sampling_is_seeded_and_order_independent() -> None:
    from fedloom import ClientInfo

    clients = [ClientInfo(f"id{i}", f"c{i}") for i in range(10)]
    a = FedAvg(selection=SelectionConfig(fraction_fit=0.3, min_fit_clients=2, seed=7))
    b = FedAvg(selection=SelectionConfig(fraction_fit=0.3, min_fit_clients=2, seed=7))
    plan_a = a.configure_fit(1, Weights(), clients)
    plan_b = b.configure_fit(1, Weights(), list(reversed(clients)))
    assert plan_a.client_ids == plan_b.client_ids and len(plan_a.client_ids) == 3
    state = a.state_dict()
    c = FedAvg(selection=SelectionConfig(fraction_fit=0.3, min_fit_clients=2, seed=0))
    c.load_state_dict(state)
    assert (
        a.configure_fit(2, Weights(), clients).client_ids
        == c.configure_fit(2, Weights(), clients).client_ids
    )
