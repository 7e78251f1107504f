"""`ComposedStrategy`: client selection + an Aggregator + a ServerOptimizer.

Named strategies (`FedAvg`, and the family built on it) are presets of this class.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from fedloom.errors import ConfigError
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
        fraction_fit: share of connected clients sampled for training each round.
        min_fit_clients: never sample fewer (if that many are connected).
        fraction_evaluate: share sampled for federated evaluation (0 disables it).
        min_evaluate_clients: never sample fewer for evaluation, when it is enabled.
        seed: seeds client sampling; the sampler's state is part of `state_dict`.
        fit_config: extra entries sent to every client with each fit task.
        evaluate_config: extra entries sent with each evaluate task.
    """

    def __init__(
        self,
        aggregator: Aggregator,
        optimizer: ServerOptimizer,
        *,
        fraction_fit: float = 1.0,
        min_fit_clients: int = 2,
        fraction_evaluate: float = 1.0,
        min_evaluate_clients: int = 0,
        seed: int = 0,
        fit_config: Mapping[str, Scalar] | None = None,
        evaluate_config: Mapping[str, Scalar] | None = None,
    ) -> None:
        if not 0.0 < fraction_fit <= 1.0:
            raise ConfigError("fraction_fit", f"must be in (0, 1], got {fraction_fit}")
        if not 0.0 <= fraction_evaluate <= 1.0:
            raise ConfigError("fraction_evaluate", f"must be in [0, 1], got {fraction_evaluate}")
        if min_fit_clients < 1:
            raise ConfigError("min_fit_clients", f"must be at least 1, got {min_fit_clients}")
        if min_evaluate_clients < 0:
            raise ConfigError("min_evaluate_clients", "must be >= 0")
        self.aggregator = aggregator
        self.optimizer = optimizer
        self.fraction_fit = fraction_fit
        self.min_fit_clients = min_fit_clients
        self.fraction_evaluate = fraction_evaluate
        self.min_evaluate_clients = min_evaluate_clients
        self.fit_config: dict[str, Scalar] = dict(fit_config or {})
        self.evaluate_config: dict[str, Scalar] = dict(evaluate_config or {})
        self.sampler = ClientSampler(seed)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(aggregator={type(self.aggregator).__name__}, "
            f"optimizer={type(self.optimizer).__name__}, fraction_fit={self.fraction_fit})"
        )

    # -- fit -------------------------------------------------------------------------
    def fit_round_config(self, server_round: int) -> Config:
        """The config every sampled client receives (subclasses add their entries)."""
        return {**self.fit_config, "server_round": server_round}

    def configure_fit(
        self, server_round: int, current: Weights, clients: Sequence[ClientInfo]
    ) -> FitPlan:
        chosen = self.sampler.sample(clients, self.fraction_fit, self.min_fit_clients)
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
        if self.fraction_evaluate == 0.0:
            return EvaluatePlan(())
        chosen = self.sampler.sample(clients, self.fraction_evaluate, self.min_evaluate_clients)
        return EvaluatePlan(chosen, {**self.evaluate_config, "server_round": server_round})

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
