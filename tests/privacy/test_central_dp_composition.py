"""`CentralDPStrategy` around the server optimizers: the inner strategy steps on the
noised mean; robust and norm-bounded rules are refused."""

from __future__ import annotations

import numpy as np
import pytest
from central_dp_support import central, clipped, delta_of_norm, dp_strategy, model, run_round

from fedloom import ClientUpdate, ConfigError, StrategyConfig, Weights
from fedloom.config import SelectionConfig
from fedloom.privacy import PrivacyConfig
from fedloom.strategies import (
    STRATEGIES,
    CentralDPStrategy,
    ComposedStrategy,
    FedAdam,
    FedAvg,
    FedAvgM,
    apply_privacy,
    build_strategy,
)
from fedloom.strategies._dp import DP_MEAN_ID


def _twins(name: str) -> tuple[ComposedStrategy, ComposedStrategy]:
    def make() -> ComposedStrategy:
        if name == "fedavg":
            return FedAvg(selection=SelectionConfig(min_fit_clients=3))
        if name == "fedavgm":
            return FedAvgM(server_learning_rate=0.7, server_momentum=0.9,
                           selection=SelectionConfig(min_fit_clients=3))
        return FedAdam(eta=0.05, beta_1=0.9, beta_2=0.99, tau=1e-3,
                       selection=SelectionConfig(min_fit_clients=3))

    return make(), make()


@pytest.mark.parametrize("name", ["fedavg", "fedavgm", "fedadam"])
def test_the_inner_optimizer_steps_on_the_noised_mean(name: str) -> None:
    inner, reference = _twins(name)
    strategy = dp_strategy(inner, clip_norm=0.5)
    rng = np.random.default_rng(11)
    current = expected = model()
    for server_round in (1, 2, 3):
        deltas = {f"c{i:03d}": delta_of_norm(rng, float(rng.uniform(0.1, 2.0)))
                  for i in range(3)}
        _, result = run_round(strategy, server_round, current, 3, deltas.__getitem__)
        assert result.weights is not None
        mean = Weights({"w": sum(clipped(d, 0.5)["w"] for d in deltas.values()) / 3,
                        "b": sum(clipped(d, 0.5)["b"] for d in deltas.values()) / 3,
                        "steps": np.zeros((), np.int64)})
        mean = Weights((k, v.astype(expected[k].dtype)) for k, v in mean.items())
        step = reference.aggregate_fit(server_round, expected,
                                       [ClientUpdate(DP_MEAN_ID, mean, 1, server_round - 1)])
        assert step.weights is not None
        assert result.weights.allclose(step.weights, rtol=1e-5, atol=1e-6)
        current, expected = result.weights, step.weights


DP_NAMES = ("fedavg", "fedavgm", "fedprox", "fedadagrad", "fedadam", "fedyogi")


@pytest.mark.parametrize("name", sorted(set(STRATEGIES) - set(DP_NAMES)))
def test_robust_rules_are_refused(name: str) -> None:
    strategy = build_strategy(StrategyConfig(name), SelectionConfig(min_fit_clients=10,
                                                                    fraction_evaluate=0.0))
    with pytest.raises(ConfigError) as info:
        apply_privacy(strategy, central())
    assert info.value.setting == "strategy.name"
    with pytest.raises(ConfigError):
        CentralDPStrategy(strategy, central())


@pytest.mark.parametrize("name", DP_NAMES)
def test_mean_strategies_are_wrapped(name: str) -> None:
    strategy = build_strategy(StrategyConfig(name), SelectionConfig(min_fit_clients=2,
                                                                    fraction_evaluate=0.0))
    wrapped = apply_privacy(strategy, central())
    assert isinstance(wrapped, CentralDPStrategy) and wrapped.inner is strategy
    assert apply_privacy(wrapped, central()) is wrapped  # not wrapped twice


def test_a_norm_bounded_strategy_is_refused() -> None:
    strategy = build_strategy(StrategyConfig("fedavg", {"max_update_norm": 1.0}),
                              SelectionConfig(fraction_fit=1.0, min_fit_clients=2,
                                              fraction_evaluate=0.0, min_evaluate_clients=0))
    with pytest.raises(ConfigError) as info:
        apply_privacy(strategy, central())
    assert info.value.setting == "strategy.max_update_norm"


def test_privacy_off_leaves_the_strategy_unchanged() -> None:
    strategy = FedAvg()
    assert apply_privacy(strategy, PrivacyConfig()) is strategy
    assert apply_privacy(strategy, PrivacyConfig(mode="off", noise_multiplier=3.0)) is strategy
    with pytest.raises(ConfigError) as info:
        CentralDPStrategy(FedAvg(), PrivacyConfig())
    assert info.value.setting == "privacy.mode"
