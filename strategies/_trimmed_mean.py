"""FedTrimmedAvg: the coordinate-wise beta-trimmed mean of the deltas (Yin et al.,
"Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates", ICML 2018).

For each coordinate, the ``k = int(beta * n)`` largest and ``k`` smallest of the ``n``
values are dropped and the rest averaged, unweighted (``num_examples`` is ignored).
The cut is Flower 1.42's (``int(beta * n)``, as in ``scipy.stats.trim_mean``).
Translation-invariant, so trimming the deltas equals trimming the client weights.

Precondition: with ``beta > 0`` the trimmed mean is only robust if it trims something,
i.e. ``int(beta * n) >= 1``. With ``enforce_preconditions`` (default) a round with too
few updates raises `AggregationError` naming the minimum; without it (Flower's
behaviour) such a round silently averages every update.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from fedloom.config import SelectionConfig
from fedloom.errors import AggregationError, ConfigError
from fedloom.strategies._base import MeanUpdate
from fedloom.strategies._composed import ComposedStrategy
from fedloom.strategies._holding import HoldingAggregator, per_tensor, stack
from fedloom.strategies._metrics import MetricsAggregationFn
from fedloom.strategies._optimizers import ServerSGD
from fedloom.types import Scalar
from fedloom.weights import Weights


def min_updates_to_trim(beta: float) -> int:
    """The smallest ``n`` with ``int(beta * n) >= 1`` (1 when ``beta == 0``)."""
    if beta == 0.0:
        return 1
    n = max(1, math.floor(1.0 / beta))
    while int(beta * n) < 1:
        n += 1
    return n


def trimmed_mean(values: np.ndarray, beta: float) -> np.ndarray:
    """Mean over axis 0 after dropping ``int(beta * n)`` values at each end, per coordinate."""
    n = values.shape[0]
    cut = int(beta * n)
    if cut == 0:
        return values.mean(axis=0)
    part = np.partition(values, (cut, n - cut - 1), axis=0)
    return part[cut : n - cut].mean(axis=0)


class TrimmedMeanAggregator(HoldingAggregator):
    """Coordinate-wise trimmed mean of the held deltas, in float64.

    Args:
        beta: fraction cut from each end, in [0, 0.5).
        enforce_preconditions: refuse a round where ``int(beta * n) == 0 < beta``.
    """

    def __init__(self, beta: float = 0.2, enforce_preconditions: bool = True) -> None:
        super().__init__()
        if not 0.0 <= beta < 0.5:
            raise ConfigError("beta", f"must be in [0, 0.5), got {beta}")
        self.beta = float(beta)
        self.enforce_preconditions = enforce_preconditions

    @property
    def min_updates(self) -> int:
        """Enough updates to trim one from each end, when preconditions are enforced."""
        return min_updates_to_trim(self.beta) if self.enforce_preconditions else 1

    def combine(
        self, current: Weights, deltas: Sequence[Weights], num_examples: Sequence[int]
    ) -> MeanUpdate:
        n = len(deltas)
        if self.enforce_preconditions and self.beta > 0 and int(self.beta * n) == 0:
            need = min_updates_to_trim(self.beta)
            raise AggregationError(
                f"FedTrimmedAvg precondition failed: with beta={self.beta} it needs at least "
                f"{need} updates to trim one from each end (int(beta * n) >= 1), got n={n}; "
                "sample more clients (min_fit_clients), raise beta, or set "
                "enforce_preconditions = false to average untrimmed as Flower does"
            )
        means = {name: trimmed_mean(stack(deltas, name), self.beta) for name in current}
        return MeanUpdate(per_tensor(current, means), float(sum(num_examples)), n)


class FedTrimmedAvg(ComposedStrategy):
    """FedTrimmedAvg: the coordinate-wise trimmed mean of the deltas (Yin et al., 2018).

    Flower 1.42's ``FedTrimmedAvg``. Holds every update of the round.

    Args:
        beta: fraction cut off each end of every coordinate, in [0, 0.5). Default 0.2
            (Flower's).
        enforce_preconditions: raise `AggregationError` when ``int(beta * n) == 0``
            although ``beta > 0`` (nothing would be trimmed). Default true; false is
            Flower's behaviour (average everything).
        selection: which clients each round samples (default: `SelectionConfig()`).
        fit_config: extra entries sent to every client with each fit task.
        evaluate_config: extra entries sent with each evaluate task.
        fit_metrics_aggregation_fn: Flower's hook over the clients' fit metrics
            (see `ComposedStrategy`; default: weighted means).
        evaluate_metrics_aggregation_fn: Flower's hook over the clients' evaluate
            metrics (see `ComposedStrategy`; default: weighted means).
    """

    def __init__(
        self,
        *,
        beta: float = 0.2,
        enforce_preconditions: bool = True,
        selection: SelectionConfig | None = None,
        fit_config: Mapping[str, Scalar] | None = None,
        evaluate_config: Mapping[str, Scalar] | None = None,
        fit_metrics_aggregation_fn: MetricsAggregationFn | None = None,
        evaluate_metrics_aggregation_fn: MetricsAggregationFn | None = None,
    ) -> None:
        super().__init__(
            TrimmedMeanAggregator(beta, enforce_preconditions),
            ServerSGD(1.0),
            selection=selection,
            fit_config=fit_config,
            evaluate_config=evaluate_config,
            fit_metrics_aggregation_fn=fit_metrics_aggregation_fn,
            evaluate_metrics_aggregation_fn=evaluate_metrics_aggregation_fn,
        )
