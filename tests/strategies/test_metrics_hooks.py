"""Flower's metrics aggregation hooks on every strategy, against Flower 1.42's legacy
strategies (``flwr.server.strategy``) as the oracle, and what happens when a hook fails."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from fedloom import ClientInfo, ClientUpdate, EvaluateResult, StrategyConfig, Weights
from fedloom.config import ConfigError, SelectionConfig
from fedloom.privacy import PrivacyConfig
from fedloom.secagg import SecAggConfig, SecAggResult, flatten
from fedloom.strategies import (
    STRATEGIES,
    CentralDPStrategy,
    FedAdam,
    FedAvg,
    aggregate_secure_mean,
    build_strategy,
    check_secure_strategy,
    strategy_settings,
)
from fedloom.strategies._metrics import weighted_metric_means

NUM_CLIENTS = 7  # Bulyan needs n >= 4f + 3; Krum and Multi-Krum need n >= 2f + 3
OWN_FIT_KEYS = {"num_updates", "num_examples", "num_ignored_proximal_mu"}


def weighted_average(metrics: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """Flower's tutorial hook: the examples-weighted mean accuracy."""
    accuracies = [num_examples * m["accuracy"] for num_examples, m in metrics]
    examples = [num_examples for num_examples, _ in metrics]
    return {"accuracy": sum(accuracies) / sum(examples)}


def summary(metrics: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """A hook of mixed value types that also shows how many results it saw, in order."""
    return {"count": len(metrics), "examples": sum(n for n, _ in metrics),
            "best": max(m["accuracy"] for _, m in metrics), "first": metrics[0][1]["tag"],
            "all_positive": all(n > 0 for n, _ in metrics)}


def both(metrics: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    return {**weighted_average(metrics), **summary(metrics)}


class Round:
    """One random round: current weights, client models, examples and metrics."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.current = Weights({"w": rng.normal(size=(3, 2)).astype(np.float32),
                                "b": rng.normal(size=2).astype(np.float32)})
        self.models = [Weights({k: (v + 0.3 * rng.normal(size=v.shape)).astype(np.float32)
                                for k, v in self.current.items()}) for _ in range(NUM_CLIENTS)]
        self.examples = [int(n) for n in rng.integers(1, 50, NUM_CLIENTS)]
        self.fit_metrics = [{"accuracy": float(rng.uniform()), "tag": f"c{i}",
                             "proximal_mu": 0.1} for i in range(NUM_CLIENTS)]
        self.losses = [float(x) for x in rng.uniform(0, 3, NUM_CLIENTS)]
        self.eval_metrics = [{"accuracy": float(rng.uniform()), "tag": f"e{i}"}
                             for i in range(NUM_CLIENTS)]

    def updates(self) -> list[ClientUpdate]:
        return [ClientUpdate(f"c{i}", m.subtract(self.current), n, 0, metrics)
                for i, (m, n, metrics) in enumerate(
                    zip(self.models, self.examples, self.fit_metrics, strict=True))]

    def evaluations(self) -> list[EvaluateResult]:
        return [EvaluateResult(f"c{i}", n, loss, metrics) for i, (n, loss, metrics) in
                enumerate(zip(self.examples, self.losses, self.eval_metrics, strict=True))]


# fedloom name -> Flower 1.42 legacy strategy with the same rule
def _flower(name: str, fit_fn: Callable[..., Any], evaluate_fn: Callable[..., Any],
            current: Weights) -> Any:
    from flwr.common import ndarrays_to_parameters
    from flwr.server import strategy as fl

    common: dict[str, Any] = {
        "fit_metrics_aggregation_fn": fit_fn, "evaluate_metrics_aggregation_fn": evaluate_fn,
        "initial_parameters": ndarrays_to_parameters(list(current.values())),
    }
    return {
        "fedavg": lambda: fl.FedAvg(**common),
        "fedavgm": lambda: fl.FedAvgM(**common),
        "fedprox": lambda: fl.FedProx(proximal_mu=0.1, **common),
        "fedadagrad": lambda: fl.FedAdagrad(**common),
        "fedadam": lambda: fl.FedAdam(**common),
        "fedyogi": lambda: fl.FedYogi(**common),
        "fedmedian": lambda: fl.FedMedian(**common),
        "fedtrimmedavg": lambda: fl.FedTrimmedAvg(**common),
        "krum": lambda: fl.Krum(**common),
        "multikrum": lambda: fl.Krum(num_clients_to_keep=3, **common),
        # Flower's default first rule needs its ``to_keep`` passed through (0: Krum)
        "bulyan": lambda: fl.Bulyan(to_keep=0, **common),
    }[name]()


def _ours(name: str, **hooks: Any) -> Any:
    extra: dict[str, Any] = {"fedprox": {"proximal_mu": 0.1},
                             "multikrum": {"num_nodes_to_select": 3}}.get(name, {})
    return STRATEGIES[name](**extra, **hooks)


def _flower_results(rnd: Round) -> tuple[list[Any], list[Any]]:
    from flwr.common import Code, EvaluateRes, FitRes, Status, ndarrays_to_parameters

    ok = Status(Code.OK, "")
    fit = [(None, FitRes(ok, ndarrays_to_parameters(list(m.values())), n, dict(metrics)))
           for m, n, metrics in zip(rnd.models, rnd.examples, rnd.fit_metrics, strict=True)]
    evaluate = [(None, EvaluateRes(ok, loss, n, dict(metrics))) for n, loss, metrics in
                zip(rnd.examples, rnd.losses, rnd.eval_metrics, strict=True)]
    return fit, evaluate


@pytest.fixture(autouse=True)
def _quiet_flower() -> None:
    logging.getLogger("flwr").setLevel(logging.ERROR)


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("seed", [0, 1])
def test_every_strategys_hooks_give_what_flowers_give(name: str, seed: int) -> None:
    rnd = Round(seed)
    flower = _flower(name, both, both, rnd.current)
    ours = _ours(name, fit_metrics_aggregation_fn=both, evaluate_metrics_aggregation_fn=both)
    fit_results, eval_results = _flower_results(rnd)

    _, flower_fit = flower.aggregate_fit(1, fit_results, [])
    result = ours.aggregate_fit(1, rnd.current, rnd.updates())
    assert result.weights is not None
    got = {k: v for k, v in result.metrics.items() if k not in OWN_FIT_KEYS}
    assert got == pytest.approx(flower_fit)
    # a robust rule's hook sees every result, not only the updates the rule selects
    assert got["count"] == NUM_CLIENTS and got["first"] == "c0"

    flower_loss, flower_eval = flower.aggregate_evaluate(1, eval_results, [])
    metrics = dict(ours.aggregate_evaluate(1, rnd.evaluations()))
    assert metrics.pop("loss") == pytest.approx(flower_loss)
    assert metrics.pop("num_examples") == sum(rnd.examples)
    assert metrics == pytest.approx(flower_eval)
    assert metrics["first"] == "e0"  # the evaluate hook gets the evaluate metrics


def test_without_hooks_fit_and_evaluate_average_each_numeric_metric() -> None:
    # Flower reports {} without a hook; fedloom keeps its weighted means (documented).
    rnd = Round(3)
    result = FedAvg().aggregate_fit(1, rnd.current, rnd.updates())
    n = np.array(rnd.examples, float)
    accuracy = float(np.dot(n, [m["accuracy"] for m in rnd.fit_metrics]) / n.sum())
    assert result.metrics == pytest.approx({"accuracy": accuracy, "proximal_mu": 0.1,
                                            "num_updates": 7, "num_examples": int(n.sum())})
    evaluate = FedAvg().aggregate_evaluate(1, rnd.evaluations())
    assert evaluate["loss"] == pytest.approx(float(np.dot(n, rnd.losses) / n.sum()))
    assert evaluate == pytest.approx(
        {**weighted_metric_means((r.num_examples, {**r.metrics, "loss": r.loss})
                                 for r in rnd.evaluations()), "num_examples": int(n.sum())})


def test_the_strategys_own_counts_follow_the_hooks_output() -> None:
    rnd = Round(4)

    def claims(_: Any) -> dict[str, Any]:
        return {"num_updates": -1, "num_examples": -1, "loss": -1.0, "kept": 1}

    strategy = FedAvg(fit_metrics_aggregation_fn=claims, evaluate_metrics_aggregation_fn=claims)
    fit = strategy.aggregate_fit(1, rnd.current, rnd.updates()).metrics
    assert fit == {"num_updates": 7, "num_examples": sum(rnd.examples), "loss": -1.0, "kept": 1}
    evaluate = strategy.aggregate_evaluate(1, rnd.evaluations())
    assert evaluate["num_examples"] == sum(rnd.examples) and evaluate["kept"] == 1
    assert evaluate["loss"] == pytest.approx(
        float(np.dot(rnd.examples, rnd.losses) / sum(rnd.examples)))


def _raises(_: Any) -> dict[str, Any]:
    raise KeyError("accuracy")


@pytest.mark.parametrize(("hook", "message"), [
    (_raises, "fit_metrics_aggregation_fn failed, its metrics are dropped for this round "
              "(the model is not affected): KeyError: 'accuracy'"),
    (lambda _: None, "fit_metrics_aggregation_fn must return a dict of metrics, got NoneType"),
    (lambda _: [("a", 1)], "must return a dict of metrics, got list"),
    (lambda _: {"a": [1, 2]}, "fit_metrics_aggregation_fn returned 'a' = [1, 2] (list)"),
    (lambda _: {"a": None}, "returned 'a' = None (NoneType); a metric must be a bool"),
    (lambda _: {"a": b"raw"}, "returned 'a' = b'raw' (bytes)"),
    (lambda _: {"a": float("nan")}, "returned 'a': nan is not finite"),
    (lambda _: {"a": 2**70}, "returned 'a': 1180591620717411303424 is outside the signed "
                             "64-bit range"),
    (lambda _: {"a": np.array([1.0, 2.0])}, "returned 'a' = array([1., 2.]) (ndarray)"),
    (lambda _: {3: 1.0}, "fit_metrics_aggregation_fn returned the key 3"),
    (lambda _: {"a": "x" * 5000}, "returned 'a': longer than 4096"),
    (lambda _: {f"k{i}": i for i in range(300)}, "returned 300 metrics; at most 224"),
])
def test_a_failing_fit_hook_is_logged_by_name_and_the_round_keeps_its_model(
        hook: Callable[..., Any], message: str, caplog: pytest.LogCaptureFixture) -> None:
    rnd = Round(5)
    plain = FedAdam()
    expected = plain.aggregate_fit(3, rnd.current, rnd.updates())
    strategy = FedAdam(fit_metrics_aggregation_fn=hook)
    with caplog.at_level(logging.ERROR, logger="fedloom.strategies._metrics"):
        result = strategy.aggregate_fit(3, rnd.current, rnd.updates())
    (record,) = caplog.records
    assert record.getMessage().startswith("round 3: fit_metrics_aggregation_fn failed")
    assert message in record.getMessage()
    # log and drop: the model and the optimizer's state are those of a round without it
    assert result.weights is not None and expected.weights is not None
    for name in expected.weights:
        np.testing.assert_array_equal(result.weights[name], expected.weights[name])
    assert result.metrics == {"num_updates": 7, "num_examples": sum(rnd.examples)}
    for key, value in plain.state_dict()["optimizer"].items():
        np.testing.assert_equal(strategy.state_dict()["optimizer"][key], value)


def test_a_failing_evaluate_hook_leaves_the_loss(caplog: pytest.LogCaptureFixture) -> None:
    rnd = Round(6)
    strategy = FedAvg(evaluate_metrics_aggregation_fn=_raises)
    with caplog.at_level(logging.ERROR, logger="fedloom.strategies._metrics"):
        metrics = strategy.aggregate_evaluate(2, rnd.evaluations())
    assert set(metrics) == {"loss", "num_examples"}
    assert "round 2: evaluate_metrics_aggregation_fn failed" in caplog.text


def test_hooks_get_copies_and_numpy_scalars_become_numbers() -> None:
    rnd = Round(7)
    updates = rnd.updates()

    def meddles(results: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
        for _, metrics in results:
            metrics.clear()
        return {"count": np.int64(len(results)), "mean": np.float32(0.5), "ok": np.bool_(True)}

    metrics = FedAvg(fit_metrics_aggregation_fn=meddles).aggregate_fit(
        1, rnd.current, updates).metrics
    assert metrics["count"] == 7 and type(metrics["count"]) is int
    assert type(metrics["mean"]) is float and metrics["ok"] is True
    assert [u.metrics for u in updates] == rnd.fit_metrics  # the clients' records untouched


def test_hooks_are_not_called_without_results_or_without_a_model() -> None:
    calls: list[int] = []

    def counting(results: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
        calls.append(len(results))
        return {}

    rnd = Round(8)
    strategy = STRATEGIES["bulyan"](num_malicious_nodes=1, fit_metrics_aggregation_fn=counting,
                                    evaluate_metrics_aggregation_fn=counting,
                                    enforce_preconditions=False)
    result = strategy.aggregate_fit(1, rnd.current, rnd.updates()[:3])  # n < 4f + 3
    assert result.weights is None and calls == []
    assert strategy.aggregate_evaluate(1, []) == {} and calls == []


def _secure_outcome(rnd: Round) -> SecAggResult:
    mean = flatten(rnd.models[0].subtract(rnd.current))
    return SecAggResult(mean, mean * 3, 3.0, 30.0, ("a", "b", "c"), ())


def test_under_secure_aggregation_the_fit_hook_is_not_called(
        caplog: pytest.LogCaptureFixture) -> None:
    calls: list[Any] = []
    strategy = FedAvg(fit_metrics_aggregation_fn=lambda r: calls.append(r) or {"x": 1})
    with caplog.at_level(logging.WARNING, logger="fedloom.strategies._metrics"):
        check_secure_strategy(strategy, SecAggConfig(enabled=True, allow_unauthenticated=True))
    assert "fit_metrics_aggregation_fn is not called under secure aggregation" in caplog.text
    rnd = Round(9)
    result = aggregate_secure_mean(strategy, 1, rnd.current, _secure_outcome(rnd))
    assert result.weights is not None and calls == []
    assert result.metrics == {"num_updates": 3, "num_examples": 30}


def test_under_central_dp_the_fit_hook_is_not_called(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[Any] = []
    inner = FedAvg(selection=SelectionConfig(min_fit_clients=1),
                   fit_metrics_aggregation_fn=lambda r: calls.append(r) or {"x": 1})
    privacy = PrivacyConfig(mode="central", noise_multiplier=1e-9, clip_norm=1.0)
    with caplog.at_level(logging.WARNING, logger="fedloom.strategies._metrics"):
        strategy = CentralDPStrategy(inner, privacy, rng=np.random.default_rng(0))
    assert "fit_metrics_aggregation_fn is not called under [privacy]" in caplog.text
    rnd = Round(10)
    infos = [ClientInfo(f"c{i}") for i in range(NUM_CLIENTS)]
    plan = strategy.configure_fit(1, rnd.current, infos)
    updates = [u for u in rnd.updates() if u.client_id in plan.client_ids]
    result = strategy.aggregate_fit(1, rnd.current, updates)
    assert result.weights is not None and calls == [] and "x" not in result.metrics


def test_hooks_are_python_arguments_not_strategy_settings() -> None:
    for name in STRATEGIES:
        assert not {"fit_metrics_aggregation_fn", "evaluate_metrics_aggregation_fn"} & set(
            strategy_settings(name))
    with pytest.raises(ConfigError) as info:
        build_strategy(StrategyConfig("fedadam", {"fit_metrics_aggregation_fn": "m:f"}))
    assert info.value.setting == "strategy.fit_metrics_aggregation_fn"
    assert "FedAdam(fit_metrics_aggregation_fn=...)" in str(info.value)
    assert "Server(strategy=...)" in str(info.value)
    with pytest.raises(TypeError, match="evaluate_metrics_aggregation_fn must be a callable"):
        FedAvg(evaluate_metrics_aggregation_fn="module:fn")  # type: ignore[arg-type]


def test_the_local_engine_records_the_hooks_output() -> None:
    from fedloom.client_sdk import Client, EvaluateOutput, FitOutput
    from fedloom.simulations.local_engine import run_local

    class Shift(Client):
        def __init__(self, index: int) -> None:
            self.index = index

        def fit(self, weights: Weights, config: Any) -> FitOutput:
            new = Weights((k, v + 1.0) for k, v in weights.items())
            return FitOutput(new, self.index + 1, {"accuracy": 0.1 * self.index, "tag": "t"})

        def evaluate(self, weights: Weights, config: Any) -> EvaluateOutput:
            return EvaluateOutput(1.0, self.index + 1, {"accuracy": 0.1 * self.index,
                                                        "tag": "t"})

    clients = [Shift(i) for i in range(4)]
    strategy = FedAvg(selection=SelectionConfig(min_fit_clients=4, seed=0),
                      fit_metrics_aggregation_fn=summary,
                      evaluate_metrics_aggregation_fn=weighted_average)
    history = run_local(strategy, clients.__getitem__, Weights({"w": np.zeros(2)}),
                        num_clients=4, num_rounds=2)
    # accuracy weighted by examples (1, 2, 3, 4): (0 + 0.2 + 0.6 + 1.2) / 10 = 0.2
    for record in history.rounds[1:]:
        hooked = {"count": 4, "examples": 10, "best": 0.3, "first": "t", "all_positive": True,
                  "num_updates": 4, "num_examples": 10}
        # (the engine adds the traffic it simulated to the fit metrics)
        assert {k: record.fit[k] for k in hooked} == pytest.approx(hooked)
        assert "accuracy" not in record.fit  # the hook's output replaced the default means
        assert record.evaluate == pytest.approx({"accuracy": 0.2, "loss": 1.0,
                                                 "num_examples": 10})
        assert record.metrics["federated_accuracy"] == pytest.approx(0.2)


@pytest.mark.parametrize(("config", "message"), [
    ({"x": None}, r"fit_config\['x'\]: NoneType is not a bool, int, float, str or bytes"),
    ({"x": {"a": 1}}, r"fit_config\['x'\]: dict is not a bool"),
    ({"x": float("nan")}, r"fit_config\['x'\]: nan is not finite"),
])
def test_a_fit_config_the_wire_cannot_carry_is_refused_when_the_strategy_is_made(
        config: dict[str, Any], message: str) -> None:
    # It used to pass until round 1's tasks were made, after the run had started.
    with pytest.raises(ConfigError, match=message):
        FedAvg(fit_config=config)
    with pytest.raises(ConfigError, match=message.replace("fit_config", "evaluate_config")):
        FedAvg(evaluate_config=config)
    taken = FedAvg(fit_config={"lr": np.float32(0.5), "local_epochs": np.int64(2)}).fit_config
    assert taken == {"lr": 0.5, "local_epochs": 2}  # numpy scalars, as the values they hold
    assert [type(v) for v in taken.values()] == [float, int]
