"""FedAvg (McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data", AISTATS 2017): the examples-weighted mean of client models."""

from __future__ import annotations

from collections.abc import Mapping

from fedloom.config import SelectionConfig
from fedloom.strategies._composed import ComposedStrategy
from fedloom.strategies._mean import WeightedMeanAggregator
from fedloom.strategies._metrics import MetricsAggregationFn
from fedloom.strategies._optimizers import ServerSGD
from fedloom.types import Scalar


class FedAvg(ComposedStrategy):
    """Streaming weighted mean of deltas, applied with server SGD at lr 1.

    >>> import numpy as np
    >>> from fedloom import ClientUpdate, Weights
    >>> current = Weights({"w": np.zeros(2, np.float32)})
    >>> ups = [ClientUpdate("a", Weights({"w": np.array([1, 1], np.float32)}), 1, 0),
    ...        ClientUpdate("b", Weights({"w": np.array([4, 4], np.float32)}), 3, 0)]
    >>> FedAvg().aggregate_fit(1, current, ups).weights["w"]
    array([3.25, 3.25], dtype=float32)
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
            WeightedMeanAggregator(),
            ServerSGD(1.0),
            selection=selection,
            fit_config=fit_config,
            evaluate_config=evaluate_config,
            fit_metrics_aggregation_fn=fit_metrics_aggregation_fn,
            evaluate_metrics_aggregation_fn=evaluate_metrics_aggregation_fn,
        )
