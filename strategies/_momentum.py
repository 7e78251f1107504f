"""FedAvgM: FedAvg with server momentum (Hsu, Qi and Brown, "Measuring the Effects of
Non-Identical Data Distribution for Federated Visual Classification", arXiv:1909.06335,
2019).

The server treats the negated mean delta as a pseudo-gradient and applies SGD with
momentum to it: ``m <- server_momentum * m + mean_delta``, then
``w <- w + server_learning_rate * m`` (no Nesterov; PyTorch's SGD convention, as in
Flower 1.42's ``FedAvgM``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedloom.config import SelectionConfig
from fedloom.errors import ConfigError
from fedloom.strategies._base import ServerOptimizer, StateDict, check_finite_step
from fedloom.strategies._composed import ComposedStrategy
from fedloom.strategies._mean import WeightedMeanAggregator
from fedloom.strategies._metrics import MetricsAggregationFn
from fedloom.strategies._optimizers import add_delta
from fedloom.strategies._state import (
    Buffers,
    buffer_for,
    buffers_from_state,
    buffers_to_state,
    check_buffer_names,
)
from fedloom.types import Scalar
from fedloom.weights import Weights


class ServerMomentum(ServerOptimizer):
    """Server SGD with heavy-ball momentum on the mean delta (Hsu et al., 2019).

    Floating-point tensors: ``m <- server_momentum * m + mean_delta`` (float64 buffer,
    starting at zero, which equals Flower's "first momentum is the first pseudo-gradient")
    and ``w <- w + server_learning_rate * m``. Integer tensors (buffers such as
    ``num_batches_tracked``) keep no momentum: they move by
    ``rint(server_learning_rate * mean_delta)``, as with `ServerSGD`.

    Args:
        server_learning_rate: server step size, > 0 (1.0 with momentum 0 is FedAvg).
        server_momentum: momentum factor in [0, 1); 0 keeps no buffer.
    """

    def __init__(self, server_learning_rate: float = 1.0, server_momentum: float = 0.0) -> None:
        if not (np.isfinite(server_learning_rate) and server_learning_rate > 0):
            raise ConfigError(
                "server_learning_rate", f"must be a positive number, got {server_learning_rate}"
            )
        if not 0.0 <= server_momentum < 1.0:
            raise ConfigError("server_momentum", f"must be in [0, 1), got {server_momentum}")
        self.server_learning_rate = float(server_learning_rate)
        self.server_momentum = float(server_momentum)
        self._momentum: Buffers | None = None

    def step(self, current: Weights, mean_delta: Weights) -> Weights:
        check_buffer_names(self._momentum, list(current), "momentum")
        keep = self.server_momentum > 0.0
        new_momentum: Buffers = {}
        out: list[tuple[str, np.ndarray]] = []
        for name, arr in current.items():
            delta = mean_delta[name]
            if arr.dtype.kind != "f":
                out.append((name, add_delta(Weights({name: arr}), Weights({name: delta}),
                                            self.server_learning_rate)[name]))
                continue
            m = delta.astype(np.float64)
            if keep:
                previous = buffer_for(self._momentum, name, arr, 0.0, "momentum")
                m = self.server_momentum * previous + m
                new_momentum[name] = m
            new = arr.astype(np.float64) + self.server_learning_rate * m
            out.append((name, new.astype(arr.dtype)))
        result = check_finite_step(Weights(out), momentum=new_momentum)
        if keep:  # state changes only once the whole step has succeeded
            self._momentum = new_momentum
        return result

    def state_dict(self) -> StateDict:
        return {"momentum": buffers_to_state(self._momentum)}

    def load_state_dict(self, state: StateDict) -> None:
        unknown = set(state) - {"momentum"}
        if unknown:
            raise ValueError(f"ServerMomentum state has unknown keys {sorted(unknown)}")
        self._momentum = buffers_from_state(state.get("momentum"), "momentum")


class FedAvgM(ComposedStrategy):
    """FedAvgM: FedAvg with server momentum (Hsu et al., 2019).

    Flower 1.42's ``FedAvgM``. A streaming weighted mean of the deltas (by
    ``num_examples``), applied by `ServerMomentum`. The momentum buffer is part of
    `state_dict`.

    Args:
        server_learning_rate: server step size, > 0. Default 1.0 (Flower's).
        server_momentum: momentum factor in [0, 1). Default 0.0 (Flower's; then this is
            FedAvg with a server learning rate). Hsu et al. report 0.9 working well.
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
        server_learning_rate: float = 1.0,
        server_momentum: float = 0.0,
        selection: SelectionConfig | None = None,
        fit_config: Mapping[str, Scalar] | None = None,
        evaluate_config: Mapping[str, Scalar] | None = None,
        fit_metrics_aggregation_fn: MetricsAggregationFn | None = None,
        evaluate_metrics_aggregation_fn: MetricsAggregationFn | None = None,
    ) -> None:
        super().__init__(
            WeightedMeanAggregator(),
            ServerMomentum(server_learning_rate, server_momentum),
            selection=selection,
            fit_config=fit_config,
            evaluate_config=evaluate_config,
            fit_metrics_aggregation_fn=fit_metrics_aggregation_fn,
            evaluate_metrics_aggregation_fn=evaluate_metrics_aggregation_fn,
        )
