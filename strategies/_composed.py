"""`ComposedStrategy`: client selection + an Aggregator + a ServerOptimizer.

Named strategies (`FedAvg`, and the family built on it) are presets of this class.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from fedloom.config import SelectionConfig
from fedloom.errors import ConfigError
from fedloom.fit_config import SERVER_ROUND
from fedloom.strategies._base import Aggregator, NonFiniteStepError, ServerOptimizer, StateDict
from fedloom.strategies._metrics import (
    SERVER_MEAN_IDS,
    MetricsAggregationFn,
    aggregate_metrics,
    weighted_metric_means,
)
from fedloom.strategies._sampling import ClientSampler
from fedloom.types import (
    AggregateResult,
    ClientInfo,
    ClientUpdate,
    Config,
    EvaluatePlan,
    EvaluateResult,
    FitPlan,
    Metrics,
    Scalar,
    validate_record,
)
from fedloom.weights import Weights


class ComposedStrategy:
    """A strategy made of parts; see `strategies._base` for the contract.

    Args:
        aggregator: combines the round's updates into a mean delta.
        optimizer: applies the mean delta to the global model.
        selection: which clients each round samples (default: `SelectionConfig()`); the
            server and the simulation engines pass their own. The sampler's state is
            part of `state_dict`.
        fit_config: extra entries sent to every client with each fit task.
        evaluate_config: extra entries sent with each evaluate task.
        fit_metrics_aggregation_fn: Flower's hook, ``[(num_examples, metrics), ...] ->
            metrics``, over the clients' fit metrics (Python only; see
            `strategies._metrics` for when it is called and how a failure is handled).
            Default: the examples-weighted mean of each numeric metric.
        evaluate_metrics_aggregation_fn: the same over the clients' evaluate metrics
            (without the loss, which is always the weighted mean).
    """

    def __init__(
        self,
        aggregator: Aggregator,
        optimizer: ServerOptimizer,
        *,
        selection: SelectionConfig | None = None,
        fit_config: Mapping[str, Scalar] | None = None,
        evaluate_config: Mapping[str, Scalar] | None = None,
        fit_metrics_aggregation_fn: MetricsAggregationFn | None = None,
        evaluate_metrics_aggregation_fn: MetricsAggregationFn | None = None,
    ) -> None:
        for name, hook in (("fit_metrics_aggregation_fn", fit_metrics_aggregation_fn),
                           ("evaluate_metrics_aggregation_fn", evaluate_metrics_aggregation_fn)):
            if hook is not None and not callable(hook):
                raise TypeError(f"{name} must be a callable or None, got {type(hook).__name__}")
        self.aggregator = aggregator
        self.optimizer = optimizer
        self.selection = selection if selection is not None else SelectionConfig()
        self.fit_config: dict[str, Scalar] = _checked_config(fit_config, "fit_config")
        self.evaluate_config: dict[str, Scalar] = _checked_config(evaluate_config,
                                                                  "evaluate_config")
        self.sampler = ClientSampler(self.selection.seed)
        self.fit_metrics_aggregation_fn = fit_metrics_aggregation_fn
        self.evaluate_metrics_aggregation_fn = evaluate_metrics_aggregation_fn

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(aggregator={type(self.aggregator).__name__}, "
            f"optimizer={type(self.optimizer).__name__}, selection={self.selection})"
        )

    # -- fit -------------------------------------------------------------------------
    def fit_round_config(self, server_round: int) -> Config:
        """The config every sampled client receives (subclasses add their entries)."""
        return {**self.fit_config, SERVER_ROUND: server_round}

    def configure_fit(
        self, server_round: int, current: Weights, clients: Sequence[ClientInfo]
    ) -> FitPlan:
        s = self.selection
        chosen = self.sampler.sample(clients, s.fraction_fit, s.min_fit_clients)
        return FitPlan(chosen, self.fit_round_config(server_round))

    def aggregate_fit(
        self, server_round: int, current: Weights, updates: Iterable[ClientUpdate]
    ) -> AggregateResult:
        self.aggregator.start(current)
        num_examples = 0
        from_clients: list[tuple[int, Metrics]] = []  # a server-made mean has no metrics
        for update in updates:
            self.aggregator.accumulate(update)
            num_examples += update.num_examples
            if update.client_id not in SERVER_MEAN_IDS:
                from_clients.append((update.num_examples, update.metrics))
        mean = self.aggregator.finalize()
        if mean.delta is None:
            return AggregateResult(None, num_updates=mean.num_updates, reason=mean.reason)
        _check_delta_layout(self.aggregator, current, mean.delta)
        # Before the step: the optimizer's state is the last thing a round changes.
        metrics = aggregate_metrics(self.fit_metrics_aggregation_fn,
                                    "fit_metrics_aggregation_fn", server_round, from_clients)
        step = self.optimizer.step_in_place if mean.owned else self.optimizer.step
        try:
            with np.errstate(over="ignore", invalid="ignore"):  # the step checks its result
                new_weights = step(current, mean.delta)
        except NonFiniteStepError as exc:
            return AggregateResult(None, num_updates=mean.num_updates, reason=str(exc))
        metrics["num_updates"] = mean.num_updates
        metrics["num_examples"] = num_examples
        return AggregateResult(new_weights, metrics, num_updates=mean.num_updates)

    # -- evaluate --------------------------------------------------------------------
    def configure_evaluate(
        self, server_round: int, current: Weights, clients: Sequence[ClientInfo]
    ) -> EvaluatePlan:
        s = self.selection
        if s.fraction_evaluate == 0.0:
            return EvaluatePlan(())
        chosen = self.sampler.sample_evaluation(clients, s.fraction_evaluate,
                                                s.min_evaluate_clients, server_round)
        return EvaluatePlan(chosen, {**self.evaluate_config, SERVER_ROUND: server_round})

    def aggregate_evaluate(self, server_round: int, results: Iterable[EvaluateResult]) -> Metrics:
        records = [(r.num_examples, r.metrics, r.loss) for r in results]
        if not records:
            return {}
        hook = self.evaluate_metrics_aggregation_fn
        metrics: dict[str, Scalar]
        if hook is None:  # the loss averages with the rest, under its own name
            metrics = dict(weighted_metric_means((n, {**m, "loss": loss})
                                                 for n, m, loss in records))
        else:
            metrics = aggregate_metrics(hook, "evaluate_metrics_aggregation_fn",
                                        server_round, [(n, m) for n, m, _ in records])
            loss = weighted_metric_means((n, {"loss": loss}) for n, _, loss in records)
            metrics.update(loss)  # absent only if every loss was beyond float range
        metrics["num_examples"] = sum(n for n, _, _ in records)
        return metrics

    # -- state -----------------------------------------------------------------------
    def state_dict(self) -> StateDict:
        return {"sampler": self.sampler.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: StateDict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.optimizer.load_state_dict(state.get("optimizer", {}))


def _check_delta_layout(aggregator: Aggregator, current: Weights, delta: Weights) -> None:
    """A delta with the model's tensors (names, order, shapes; its dtypes may be wider).

    An aggregator's bug, not a client's: `ValueError` naming the aggregator and the
    tensor, where the optimizer's step would fail with a bare KeyError or broadcast error.
    """
    names, expected = list(delta.keys()), list(current.keys())
    problem = ""
    if names != expected:
        missing = [n for n in expected if n not in delta]
        extra = [n for n in names if n not in current]
        problem = (f"tensor {missing[0]!r} is missing" if missing else
                   f"it has a tensor {extra[0]!r} the model has not" if extra else
                   "its tensors are in another order than the model's")
    else:
        for name, arr in current.items():
            if delta[name].shape != arr.shape:
                problem = (f"tensor {name!r} has shape {delta[name].shape}, the model's "
                           f"{arr.shape}")
                break
    if problem:
        raise ValueError(f"{type(aggregator).__name__}.finalize returned a delta that does "
                         f"not fit the model: {problem} (an aggregator returns one delta "
                         "tensor per model tensor, with its name, order and shape)")


def _checked_config(config: Mapping[str, Scalar] | None, setting: str) -> dict[str, Scalar]:
    """``config`` as every task will carry it (numpy scalars as the Python values they
    hold), checked now: a value the wire cannot carry (None, a nested dict, NaN, an int
    past 64 bits) would otherwise fail every round's tasks once the run has started."""
    try:
        return dict(validate_record(config or {}, setting))
    except ValueError as exc:
        where, _, problem = str(exc).partition(": ")
        raise ConfigError(where, problem) from exc

