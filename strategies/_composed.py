"""`ComposedStrategy`: client selection + an Aggregator + a ServerOptimizer.

Named strategies (`FedAvg`, and the family built on it) are presets of this class.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from fedloom.config import SelectionConfig
from fedloom.fit_config import SERVER_ROUND
from fedloom.strategies._base import Aggregator, ServerOptimizer, StateDict
from fedloom.strategies._metrics import weighted_metric_means
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
    """

    def __init__(
        self,
        aggregator: Aggregator,
        optimizer: ServerOptimizer,
        *,
        selection: SelectionConfig | None = None,
        fit_config: Mapping[str, Scalar] | None = None,
        evaluate_config: Mapping[str, Scalar] | None = None,
    ) -> None:
        self.aggregator = aggregator
        self.optimizer = optimizer
        self.selection = selection if selection is not None else SelectionConfig()
        self.fit_config: dict[str, Scalar] = dict(fit_config or {})
        self.evaluate_config: dict[str, Scalar] = dict(evaluate_config or {})
        self.sampler = ClientSampler(self.selection.seed)

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
        records: list[tuple[int, Metrics]] = []
        for update in updates:
            self.aggregator.accumulate(update)
            records.append((update.num_examples, update.metrics))
        mean = self.aggregator.finalize()
        if mean.delta is None:
            return AggregateResult(None, num_updates=mean.num_updates, reason=mean.reason)
        step = self.optimizer.step_in_place if mean.owned else self.optimizer.step
        new_weights = step(current, mean.delta)
        metrics: dict[str, Scalar] = dict(weighted_metric_means(records))
        metrics["num_updates"] = mean.num_updates
        metrics["num_examples"] = sum(n for n, _ in records)
        return AggregateResult(new_weights, metrics, num_updates=mean.num_updates)

    # -- evaluate --------------------------------------------------------------------
    def configure_evaluate(
        self, server_round: int, current: Weights, clients: Sequence[ClientInfo]
    ) -> EvaluatePlan:
        s = self.selection
        if s.fraction_evaluate == 0.0:
            return EvaluatePlan(())
        chosen = self.sampler.sample(clients, s.fraction_evaluate, s.min_evaluate_clients)
        return EvaluatePlan(chosen, {**self.evaluate_config, SERVER_ROUND: server_round})

    def aggregate_evaluate(self, server_round: int, results: Iterable[EvaluateResult]) -> Metrics:
        records: list[tuple[int, Metrics]] = []
        for r in results:
            records.append((r.num_examples, {**r.metrics, "loss": r.loss}))
        if not records:
            return {}
        metrics: dict[str, Scalar] = dict(weighted_metric_means(records))
        metrics["num_examples"] = sum(n for n, _ in records)
        return metrics

    # -- state -----------------------------------------------------------------------
    def state_dict(self) -> StateDict:
        return {"sampler": self.sampler.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: StateDict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.optimizer.load_state_dict(state.get("optimizer", {}))
