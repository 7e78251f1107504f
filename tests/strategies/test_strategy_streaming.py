"""Linear strategies aggregate as a stream; only the robust rules hold the round's updates.

The updates come from a generator that, each time it is resumed, counts how many of the
delta arrays it has yielded are still alive (weak references; arrays are freed by
reference counting, so no garbage collection is needed). A streaming strategy keeps at
most the update in hand (and a wrapper's loop variable); a holding one keeps them all.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import numpy as np
import pytest

from fedloom import ClientUpdate, StrategyConfig, Weights
from fedloom.strategies import STRATEGIES, build_strategy

ROBUST = {"fedmedian", "fedtrimmedavg", "krum", "multikrum", "bulyan"}
N = 8


def counting_stream(alive: list[int]) -> Iterator[ClientUpdate]:
    refs: list[weakref.ref[np.ndarray]] = []
    for i in range(N):
        update = ClientUpdate(f"c{i}", Weights({"w": np.full(256, float(i), np.float32)}),
                              1 + i, 0, {"proximal_mu": 0.1})
        refs.append(weakref.ref(update.delta["w"]))
        yield update
        del update
        alive.append(sum(r() is not None for r in refs))


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("bounded", [False, True])
def test_only_robust_rules_hold_updates(name: str, bounded: bool) -> None:
    params = {"num_malicious_nodes": 1} if name in ("krum", "multikrum", "bulyan") else {}
    if bounded:
        params["max_update_norm"] = 1e3  # the norm-bound wrapper streams too
    strategy = build_strategy(StrategyConfig(name, params))
    alive: list[int] = []
    current = Weights({"w": np.zeros(256, np.float32)})
    result = strategy.aggregate_fit(1, current, counting_stream(alive))
    assert result.weights is not None
    if name in ROBUST:
        assert alive == list(range(1, N + 1))  # every delta held until the end
    else:
        assert max(alive) <= 2, alive  # the update in hand (and a wrapper's loop variable)
