"""The secure mean as a strategy's round: shared by the gRPC rounds and the local engine.

Under secure aggregation the server learns only the weighted mean of the survivors'
clipped deltas (`fedloom.secagg.SecAggResult`). `aggregate_secure_mean` hands
that mean, as the round's one update, to the strategy's own ``aggregate_fit``, so
FedAvg, FedAvgM, FedProx and the FedOpt family apply their ServerOptimizer to it as
usual (their weighted-mean aggregator of one update returns it unchanged). A norm bound
(`NormBoundedStrategy`) is not applied again: the clients clipped their own deltas.
`check_secure_strategy` refuses the strategies that cannot run this way.

The gRPC rounds (`fedloom.server.secure`) and the local simulation engine
(`fedloom.simulations.local_secure`) both call these two functions, so a simulated
secure round composes with the strategy exactly as a deployed one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedloom.errors import ConfigError
from fedloom.secagg import SecAggConfig, SecAggResult, unflatten
from fedloom.strategies._base import Strategy
from fedloom.strategies._mean import WeightedMeanAggregator
from fedloom.strategies._metrics import SECURE_MEAN_ID, warn_unused_fit_hook
from fedloom.strategies._norm_bound import NormBoundedStrategy
from fedloom.types import AggregateResult, ClientUpdate
from fedloom.weights import Weights

#: The client id of the one update a secure round hands to the strategy.
AGGREGATE_ID = SECURE_MEAN_ID
MEAN_STRATEGIES = "fedavg, fedavgm, fedprox, fedadagrad, fedadam or fedyogi"


def check_secure_strategy(strategy: Strategy, config: SecAggConfig) -> None:
    """Refuse a strategy that cannot aggregate under secure aggregation (if enabled).

    Raises:
        ConfigError: the strategy needs the individual updates (a robust rule), or a
            norm bound that rejects updates (the server cannot see one to reject).
    """
    if not config.enabled:
        return
    if getattr(strategy, "aggregate_secure_sum", None) is not None:
        strategy = strategy.inner  # type: ignore[attr-defined]  # a wrapper of a mean
    inner: Any = strategy
    if isinstance(strategy, NormBoundedStrategy):
        if strategy.norm_bound_mode == "reject":
            raise ConfigError(
                "strategy.norm_bound_mode",
                '"reject" cannot work under secure aggregation: the server never sees one '
                'client\'s update to reject it. Use "clip" (each client then clips its own '
                "delta to max_update_norm before masking)",
            )
        inner = strategy.inner
    aggregator = getattr(inner, "aggregator", None)
    if not isinstance(aggregator, WeightedMeanAggregator) or aggregator.holds_all_updates:
        what = type(aggregator).__name__ if aggregator is not None else "its own aggregation"
        raise ConfigError(
            "strategy.name",
            f"{type(inner).__name__} aggregates with {what}, which needs each client's "
            "update (robust rules hold them all to choose among them), but under secure "
            "aggregation the server only ever holds the sum of masked updates. Use a "
            f"mean-based strategy ({MEAN_STRATEGIES}) or set secure_aggregation.enabled = "
            "false",
        )
    warn_unused_fit_hook(inner, "secure aggregation: the server never sees a client's fit "
                                "metrics, only sums")


def delta_like(flat: np.ndarray, current: Weights) -> Weights:
    """A flat float64 mean delta as tensors of ``current``'s layout, each in its own dtype,
    as any client's delta (integers round half to even, the rule the plain mean applies
    at its end)."""
    return Weights(
        (name, np.rint(arr).astype(ref.dtype) if ref.dtype.kind in "iu"
         else arr.astype(ref.dtype))
        for (name, arr), ref in zip(unflatten(flat, current.specs()).items(),
                                    current.values(), strict=True))


def secure_mean_update(outcome: SecAggResult, current: Weights,
                       server_round: int) -> ClientUpdate:
    """The secure mean as one `ClientUpdate` on the model of round ``server_round - 1``;
    its weight is the survivors' examples."""
    mean = delta_like(outcome.mean, current)
    total_examples = round(outcome.total_examples)
    return ClientUpdate(AGGREGATE_ID, mean, max(1, total_examples), server_round - 1)


def aggregate_secure_mean(strategy: Strategy, server_round: int, current: Weights,
                          outcome: SecAggResult) -> AggregateResult:
    """The strategy's step with the secure mean as the round's one update.

    The result's metrics hold the sums only: ``num_updates`` (the survivors) and
    ``num_examples`` (their examples, to within quantization), plus whatever the
    strategy itself reports. Synchronous (heavy numpy: run it off an event loop).
    """
    own_sum = getattr(strategy, "aggregate_secure_sum", None)
    if own_sum is not None:  # a strategy that decodes the sum itself (distributed DP)
        result: AggregateResult = own_sum(server_round, current, outcome)
        return result
    update = secure_mean_update(outcome, current, server_round)
    inner = strategy.inner if isinstance(strategy, NormBoundedStrategy) else strategy
    result = inner.aggregate_fit(server_round, current, [update])
    survivors = len(outcome.survivors)
    metrics = {k: v for k, v in result.metrics.items()
               if k not in ("num_updates", "num_examples")}
    metrics.update(num_updates=survivors, num_examples=round(outcome.total_examples))
    return AggregateResult(result.weights, metrics, num_updates=survivors, reason=result.reason)
