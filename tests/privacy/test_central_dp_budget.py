"""The privacy budget of `CentralDPStrategy`: each ε is dp-accounting's on events built in
`test_accountant`; rounds that release no model record nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from central_dp_support import clients, delta_of_norm, dp_strategy, model, run_round
from test_accountant import DELTA, reference_epsilon

from fedloom import Weights
from fedloom.config import SelectionConfig
from fedloom.errors import PrivacyBudgetExhausted
from fedloom.privacy import RoundEvent
from fedloom.strategies import FedAvg
from fedloom.types import AggregateResult


def test_the_budget_stops_exactly_before_the_round_that_would_exceed_it() -> None:
    z, m, n = 1.2, 4, 10
    event = RoundEvent(z, m, n)
    # Target between the epsilon of 3 and of 4 rounds (dp-accounting, directly).
    eps3, eps4 = (reference_epsilon([event] * k, "fixed") for k in (3, 4))
    target = (eps3 + eps4) / 2
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(fraction_fit=0.4, min_fit_clients=1)),
                           noise_multiplier=z, target_epsilon=target)
    rng, current, done = np.random.default_rng(6), model(), 0
    epsilons = []
    for server_round in range(1, 10):
        try:
            chosen, result = run_round(strategy, server_round, current, n,
                                       lambda cid: delta_of_norm(rng, 2.0))
        except PrivacyBudgetExhausted as exc:
            assert exc.epsilon == pytest.approx(eps3, rel=1e-9)
            assert exc.next_epsilon == pytest.approx(eps4, rel=1e-9)
            assert exc.target == target and exc.delta == DELTA
            break
        assert len(chosen) == m and result.weights is not None
        current = result.weights
        epsilons.append(float(result.metrics["privacy_epsilon"]))
        done += 1
    assert done == 3
    assert epsilons[-1] == pytest.approx(eps3, rel=1e-9) and epsilons[-1] <= target
    assert epsilons == sorted(epsilons)
    assert strategy.privacy_spent() == (pytest.approx(eps3, rel=1e-9), DELTA)
    # Refused again, and the refusal spent nothing.
    with pytest.raises(PrivacyBudgetExhausted):
        strategy.configure_fit(5, current, clients(n))
    assert strategy.accountant.num_rounds == 3


class RefusingFedAvg(FedAvg):
    """FedAvg whose aggregation produces no model (as a mean of non-finite updates does)."""

    def aggregate_fit(self, server_round: int, current: Weights,
                      updates: Any) -> AggregateResult:
        list(updates)
        return AggregateResult(None, num_updates=1, reason="refused by the test")


def test_a_round_without_a_model_records_nothing() -> None:
    strategy = dp_strategy(RefusingFedAvg(selection=SelectionConfig(min_fit_clients=3)),
                           noise_multiplier=1.0,
                           clipping="adaptive", count_noise_std=5.0)
    d = delta_of_norm(np.random.default_rng(7), 3.0)
    _, result = run_round(strategy, 1, model(), 3, lambda cid: d)
    assert result.weights is None and result.reason
    assert strategy.accountant.num_rounds == 0 and strategy.privacy_spent()[0] == 0.0
    assert strategy.clip_norm == 1.0  # C moves only when a round is released


def test_a_round_without_updates_records_nothing() -> None:
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=3)),
                           noise_multiplier=1.0)
    _, result = run_round(strategy, 1, model(), 3, lambda cid: None)
    assert result.weights is None and result.num_updates == 0
    assert strategy.accountant.num_rounds == 0 and strategy.privacy_spent()[0] == 0.0
    # The next round is accounted as usual.
    d = delta_of_norm(np.random.default_rng(8), 1.0)
    _, result = run_round(strategy, 2, model(), 3, lambda cid: d)
    assert result.weights is not None and strategy.accountant.num_rounds == 1
