"""`Aggregator.min_updates`: the fewest updates a round of each rule needs, checked
against the rule itself (``min_updates`` updates make a model, one fewer does not), and
the server's start-up warning when ``min_fit_clients`` is below it."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from fedloom import ClientUpdate, Weights
from fedloom.config import SelectionConfig, ServerConfig, StrategyConfig, from_mapping
from fedloom.errors import AggregationError
from fedloom.server import Server
from fedloom.strategies import KrumAggregator, aggregator_of, build_strategy, min_updates

CURRENT = Weights({"w": np.zeros(3, np.float32)})

RULES: list[tuple[dict[str, Any], int]] = [
    ({"name": "fedavg"}, 1),
    ({"name": "krum", "num_malicious_nodes": 1}, 5),
    ({"name": "multikrum", "num_malicious_nodes": 0, "num_nodes_to_select": 6}, 6),
    ({"name": "bulyan", "num_malicious_nodes": 1}, 7),
    ({"name": "bulyan", "num_malicious_nodes": 1, "enforce_preconditions": False}, 7),
    ({"name": "fedtrimmedavg", "beta": 0.2}, 5),
    ({"name": "krum", "num_malicious_nodes": 1, "enforce_preconditions": False}, 1),
    ({"name": "fedmedian"}, 1),
]


def _aggregate(strategy: Any, n: int) -> bool:
    """Whether ``n`` updates make a model."""
    rng = np.random.default_rng(n)
    updates = [ClientUpdate(f"c{i}", Weights({"w": rng.normal(size=3).astype(np.float32)}),
                            5, base_round=0) for i in range(n)]
    try:
        return strategy.aggregate_fit(1, CURRENT, updates).weights is not None
    except AggregationError:
        return False


@pytest.mark.parametrize(("settings", "need"), RULES)
def test_min_updates_is_the_rules_own_precondition(settings: dict[str, Any], need: int) -> None:
    strategy = build_strategy(StrategyConfig.from_table(settings), SelectionConfig())
    assert strategy.aggregator.min_updates == need
    assert _aggregate(strategy, need)
    if need > 1:
        assert not _aggregate(strategy, need - 1)


def test_min_updates_sees_through_wrappers() -> None:
    # max_update_norm wraps the rule (NormBoundedStrategy keeps it as .inner)
    bounded = build_strategy(StrategyConfig.from_table(
        {"name": "krum", "num_malicious_nodes": 1, "max_update_norm": 1.0}), SelectionConfig())
    assert not hasattr(bounded, "aggregator")
    assert isinstance(aggregator_of(bounded), KrumAggregator) and min_updates(bounded) == 5
    assert aggregator_of(object()) is None and min_updates(object()) == 1


@pytest.mark.parametrize("bounded", [False, True])
@pytest.mark.parametrize(("min_fit", "warned"), [(4, True), (5, False)])
def test_the_server_warns_when_min_fit_clients_is_below_it(
        min_fit: int, warned: bool, bounded: bool, caplog: pytest.LogCaptureFixture) -> None:
    strategy = {"name": "krum", "num_malicious_nodes": 1,
                **({"max_update_norm": 1.0} if bounded else {})}
    config = from_mapping(ServerConfig, {
        "insecure": True, "min_clients": min_fit, "min_fit_clients": min_fit,
        "strategy": strategy})
    with caplog.at_level(logging.WARNING, logger="fedloom.server"):
        Server(config)
    messages = [r.getMessage() for r in caplog.records]
    expected = ("KrumAggregator needs at least 5 updates a round, but min_fit_clients is 4: "
                "a round that samples fewer than 5 clients fails; raise min_fit_clients (and "
                "min_clients) to 5")
    assert (expected in messages) is warned
