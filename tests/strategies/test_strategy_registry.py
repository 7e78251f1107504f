"""The registry: every strategy by name, typed settings, clear errors, the help text."""

from __future__ import annotations

import inspect

import pytest

import fedloom.strategies as strategies_pkg
from fedloom import ConfigError, StrategyConfig
from fedloom.config import SelectionConfig, ServerConfig, from_mapping
from fedloom.strategies import (
    STRATEGIES,
    FedAdam,
    FedYogi,
    NormBoundedStrategy,
    build_strategy,
    describe_strategies,
    strategy_settings,
)

NAMES = ["fedavg", "fedavgm", "fedprox", "fedadagrad", "fedadam", "fedyogi", "fedmedian",
         "fedtrimmedavg", "krum", "multikrum", "bulyan"]


def test_every_name_is_registered_and_builds_with_defaults() -> None:
    assert list(STRATEGIES) == NAMES
    for name in NAMES:
        selection = SelectionConfig(fraction_fit=0.5, min_fit_clients=3, seed=1)
        built = build_strategy(StrategyConfig(name), selection)
        assert isinstance(built, STRATEGIES[name])
        assert built.selection == selection
        assert built.sampler.state_dict()["seed"] == 1
    assert isinstance(build_strategy(StrategyConfig("FedYogi")), FedYogi)  # case-insensitive


def test_settings_reach_the_constructor_typed() -> None:
    built = build_strategy(StrategyConfig("fedadam", {"eta": 1, "beta_1": 0.5, "tau": 0.01,
                                                      "bias_correction": "flower"}))
    assert isinstance(built, FedAdam)
    assert isinstance(built.optimizer.eta, float) and built.optimizer.eta == 1.0  # type: ignore[attr-defined]
    assert built.optimizer.bias_correction == "flower"  # type: ignore[attr-defined]
    krum = build_strategy(StrategyConfig("multikrum", {"num_malicious_nodes": 2,
                                                       "num_nodes_to_select": 3}))
    assert krum.aggregator.num_malicious_nodes == 2  # type: ignore[attr-defined]
    prox = build_strategy(StrategyConfig("fedprox", {"proximal_mu": 0.1,
                                                     "fit_config": {"local_epochs": 2}}))
    assert prox.fit_config == {"local_epochs": 2}  # type: ignore[attr-defined]


def test_from_a_toml_table() -> None:
    config = from_mapping(ServerConfig, {"strategy": {"name": "fedyogi", "eta": 0.02,
                                                      "max_update_norm": 4.0},
                                         "insecure": True})
    built = build_strategy(config.strategy)
    assert isinstance(built, NormBoundedStrategy) and isinstance(built.inner, FedYogi)
    assert built.inner.optimizer.eta == 0.02  # type: ignore[attr-defined]


@pytest.mark.parametrize(("name", "params", "setting", "message"), [
    ("fedavgg", {}, "strategy.name", "did you mean 'fedavg'"),
    ("nosuch", {}, "strategy.name", "known: fedavg, fedavgm"),
    ("fedadam", {"etaa": 0.1}, "strategy.etaa", "did you mean 'eta'"),
    ("fedavg", {"eta": 0.1}, "strategy.eta", "no such setting"),
    ("krum", {"fraction_fit": 0.5}, "strategy.fraction_fit", "top-level server setting"),
    ("fedavg", {"seed": 1}, "strategy.seed", "client selection"),
    ("fedavg", {"selection": {}}, "strategy.selection", "no such setting"),
    ("fedadam", {"eta": "fast"}, "strategy.eta", "must be a number"),
    ("fedadam", {"eta": True}, "strategy.eta", "must be a number"),
    ("krum", {"num_malicious_nodes": 1.5}, "strategy.num_malicious_nodes", "integer"),
    ("krum", {"num_malicious_nodes": True}, "strategy.num_malicious_nodes", "integer"),
    ("bulyan", {"enforce_preconditions": 1}, "strategy.enforce_preconditions", "true or false"),
    ("bulyan", {"selection_rule": "median"}, "strategy.selection_rule", "'krum', 'multikrum'"),
    ("fedadam", {"bias_correction": True}, "strategy.bias_correction", "one of"),
    ("fedavg", {"fit_config": 3}, "strategy.fit_config", "must be a table"),
    ("fedavg", {"fit_config": {"x": [1]}}, "strategy.fit_config.x", "boolean, number"),
    # Ranges, checked by the constructors and reported under the strategy.* name:
    ("fedtrimmedavg", {"beta": 0.5}, "strategy.beta", "[0, 0.5)"),
    ("fedadam", {"beta_1": 1.0}, "strategy.beta_1", "[0, 1)"),
    ("fedadam", {"beta_2": -0.1}, "strategy.beta_2", "[0, 1)"),
    ("fedyogi", {"tau": 0.0}, "strategy.tau", "positive"),
    ("fedadagrad", {"eta": -1.0}, "strategy.eta", "positive"),
    ("fedadagrad", {"eta_l": 0.0}, "strategy.eta_l", "positive"),
    ("fedadam", {"initial_accumulator": -1.0}, "strategy.initial_accumulator", ">= 0"),
    ("fedavgm", {"server_momentum": 1.0}, "strategy.server_momentum", "[0, 1)"),
    ("fedavgm", {"server_learning_rate": 0.0}, "strategy.server_learning_rate", "positive"),
    ("fedprox", {"proximal_mu": -0.1}, "strategy.proximal_mu", ">= 0"),
    ("krum", {"num_malicious_nodes": -1}, "strategy.num_malicious_nodes", ">= 0"),
    ("multikrum", {"num_nodes_to_select": 0}, "strategy.num_nodes_to_select", ">= 1"),
    ("fedavg", {"max_update_norm": 0}, "strategy.max_update_norm", "positive"),
])
def test_bad_configuration_names_the_setting(
    name: str, params: dict, setting: str, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        build_strategy(StrategyConfig(name, params))
    assert info.value.setting == setting
    assert message in str(info.value)


@pytest.mark.parametrize("name", NAMES)
def test_a_config_value_no_record_can_hold_is_refused_when_the_strategy_is_made(
        name: str) -> None:
    """Not at each round: an int past 64 bits used to pass the constructor, then failed
    the server's Tasks handler at every round (protobuf's "Value out of range")."""
    with pytest.raises(ValueError, match=r"fit_config\['x'\]: \d+ is outside the signed 64-bit"):
        build_strategy(StrategyConfig(name, {"fit_config": {"x": 2**70}}))
    with pytest.raises(ValueError, match=r"evaluate_config\['t'\]: nan is not finite"):
        STRATEGIES[name](evaluate_config={"t": float("nan")})


def test_server_owned_settings_are_not_strategy_settings() -> None:
    for name in NAMES:
        settings = strategy_settings(name)
        assert "seed" not in settings and "fraction_fit" not in settings
        assert "selection" not in settings
        assert {"max_update_norm", "norm_bound_mode", "fit_config"} <= set(settings)
    with pytest.raises(TypeError):
        build_strategy(StrategyConfig("fedavg"), eta=0.1)


def test_describe_lists_every_strategy_setting_and_default() -> None:
    text = describe_strategies()
    for name in NAMES:
        assert f"\n{name}: " in text
        params = inspect.signature(STRATEGIES[name].__init__).parameters
        for key, param in strategy_settings(name).items():
            assert f"    {key} (" in text, (name, key)
            if key in params and isinstance(param.default, float):
                assert f"= {param.default!r}" in text
    assert 'bias_correction ("none" | "adam" | "flower") = "none"' in text
    assert "enforce_preconditions (bool) = true" in text
    assert "eta_l (float) = 0.0316" in text
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "``" not in text


def test_every_setting_is_documented() -> None:
    from fedloom.strategies._settings import argument_docs

    for name, cls in STRATEGIES.items():
        if name == "fedavg":  # the foundation's preset: common settings only
            continue
        docs = argument_docs(cls)
        for key in inspect.signature(cls.__init__).parameters:
            if key != "self":
                assert docs.get(key), (name, key)


def test_exported_names_are_pinned() -> None:
    assert sorted(strategies_pkg.__all__) == sorted([
        "MEAN_STRATEGIES", "STRATEGIES", "AdaptiveServerOptimizer", "Aggregator", "Bulyan",
        "BulyanAggregator", "CentralDPStrategy",
        "ClientSampler", "ComposedStrategy", "CoordinateMedianAggregator", "FedAdagrad",
        "FedAdam", "FedAvg", "FedAvgM", "FedMedian", "FedProx", "FedTrimmedAvg", "FedYogi",
        "HoldingAggregator", "HookOutputError", "Krum", "KrumAggregator", "MeanUpdate",
        "MetricsAggregationFn",
        "MultiKrum", "NonFiniteStepError",
        "NormBoundedStrategy", "SelectionConfig", "ServerAdagrad", "ServerAdam", "ServerMomentum",
        "ServerOptimizer", "ServerSGD", "ServerYogi", "StalenessWeighting", "StateDict",
        "Strategy", "TrimmedMeanAggregator", "WeightedMeanAggregator", "add_delta",
        "apply_privacy", "aggregate_secure_mean", "aggregator_of", "build_strategy",
        "check_aggregatable",
        "check_finite_step", "check_robust_async", "check_secure_strategy", "checked_output",
        "clip_update", "describe_strategies", "holds_all_updates", "min_updates",
        "privacy_spent_metrics", "scale_delta",
        "stale_update", "strategy_settings",
        "update_norm", "weighted_updates",
    ])
    for name in strategies_pkg.__all__:
        assert hasattr(strategies_pkg, name), name


def test_server_help_lists_every_strategy_and_setting(capsys: pytest.CaptureFixture[str]) -> None:
    from fedloom.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["server", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for name in NAMES:
        assert f"\n{name}: " in text, name
        for key in strategy_settings(name):
            assert f"    {key} (" in text, (name, key)
    assert "docs/strategies.md" in text
