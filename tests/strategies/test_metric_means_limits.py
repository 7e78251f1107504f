"""Client-chosen metrics cannot break a round's aggregation.

Each client may send up to 256 metric keys, and values up to float's range; the
default weighted means must still fit a round's metrics record (at most 256 entries,
all finite), or the strategy would raise where the server expects a result. Played
against the real strategies as a group of hostile clients would.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from fedloom import ClientUpdate, EvaluateResult, Weights
from fedloom.strategies import FedAvg, FedMedian
from fedloom.strategies._metrics import MAX_HOOK_ENTRIES
from fedloom.types import MAX_ENTRIES

CURRENT = Weights({"w": np.zeros(3, np.float32)})


def _update(client: str, metrics: dict, num_examples: int = 1) -> ClientUpdate:  # type: ignore[type-arg]
    return ClientUpdate(client, Weights({"w": np.ones(3, np.float32)}), num_examples, 0,
                        metrics)


@pytest.mark.parametrize("strategy", [FedAvg(), FedMedian()], ids=["fedavg", "median"])
def test_disjoint_keys_beyond_the_record_limit_keep_the_most_reported(strategy, caplog) -> None:  # type: ignore[no-untyped-def]
    # Two clients with 200 keys each, 150 of them their own: 350 distinct keys in all.
    shared = {f"shared_{i:03d}": float(i) for i in range(50)}
    a = {**shared, **{f"a_{i:03d}": 1.0 for i in range(150)}}
    b = {**shared, **{f"b_{i:03d}": 2.0 for i in range(150)}}
    with caplog.at_level(logging.WARNING):
        result = strategy.aggregate_fit(1, CURRENT, [_update("a", a, 3), _update("b", b, 1)])
    assert len(result.metrics) <= MAX_ENTRIES
    # The keys both clients sent carry 4 examples, a's 3, b's 1: kept in that order
    # (then by name) up to MAX_HOOK_ENTRIES, room left for the strategy's own entries.
    kept = {key for key in result.metrics if key[:2] in ("sh", "a_", "b_")}
    assert kept == ({f"shared_{i:03d}" for i in range(50)} | {f"a_{i:03d}" for i in range(150)}
                    | {f"b_{i:03d}" for i in range(MAX_HOOK_ENTRIES - 200)})
    assert result.metrics["shared_007"] == 7.0
    assert "distinct numeric metrics" in caplog.text


def test_huge_values_times_many_examples_average_without_overflow() -> None:
    big = 1.5e308
    updates = [_update("a", {"m": big}, 10_000_000), _update("b", {"m": big}, 10_000_000)]
    result = FedAvg().aggregate_fit(1, CURRENT, updates)
    assert math.isfinite(result.metrics["m"])
    assert result.metrics["m"] == pytest.approx(big, rel=1e-12)


def test_a_huge_evaluation_loss_averages_without_overflow() -> None:
    results = [EvaluateResult("a", 10_000_000, 1.7e308, {}),
               EvaluateResult("b", 10_000_000, 1.0e308, {})]
    for strategy in (FedAvg(), FedAvg(evaluate_metrics_aggregation_fn=lambda r: {})):
        metrics = strategy.aggregate_evaluate(1, results)
        assert metrics["loss"] == pytest.approx(1.35e308, rel=1e-12)
        assert metrics["num_examples"] == 20_000_000
