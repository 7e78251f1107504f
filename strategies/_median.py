"""FedMedian: the coordinate-wise median of the deltas (Yin et al., "Byzantine-Robust
Distributed Learning: Towards Optimal Statistical Rates", ICML 2018).

Each coordinate of the update is the median of that coordinate over the round's deltas
(the mean of the two middle values when their number is even), unweighted: a client's
``num_examples`` does not move the median. Translation-invariant, so the median of the
deltas plus ``current`` is the median of the client weights (Flower 1.42's
``FedMedian`` takes the latter).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fedloom.config import SelectionConfig
from fedloom.strategies._base import MeanUpdate
from fedloom.strategies._composed import ComposedStrategy
from fedloom.strategies._holding import HoldingAggregator, per_tensor, stack
from fedloom.strategies._metrics import MetricsAggregationFn
from fedloom.strategies._optimizers import ServerSGD
from fedloom.types import Scalar
from fedloom.weights import Weights


class CoordinateMedianAggregator(HoldingAggregator):
    """Coordinate-wise median of the held deltas, computed in float64."""

    def combine(
        self, current: Weights, deltas: Sequence[Weights], num_examples: Sequence[int]
    ) -> MeanUpdate:
        medians = {name: np.median(stack(deltas, name), axis=0) for name in current}
        return MeanUpdate(per_tensor(current, medians), float(sum(num_examples)), len(deltas))


class FedMedian(ComposedStrategy):
    """FedMedian: the coordinate-wise median of the deltas (Yin et al., 2018).

    Flower 1.42's ``FedMedian``. Holds every update of the round. No settings of its own.

    Args:
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
        selection: SelectionConfig | None = None,
        fit_config: Mapping[str, Scalar] | None = None,
        evaluate_config: Mapping[str, Scalar] | None = None,
        fit_metrics_aggregation_fn: MetricsAggregationFn | None = None,
        evaluate_metrics_aggregation_fn: MetricsAggregationFn | None = None,
    ) -> None:
        super().__init__(
            CoordinateMedianAggregator(),
            ServerSGD(1.0),
            selection=selection,
            fit_config=fit_config,
            evaluate_config=evaluate_config,
            fit_metrics_aggregation_fn=fit_metrics_aggregation_fn,
            evaluate_metrics_aggregation_fn=evaluate_metrics_aggregation_fn,
        )
