"""Server optimizers: how a mean delta moves the global model."""

from __future__ import annotations

import numpy as np

from fedloom.errors import ConfigError
from fedloom.strategies._base import ServerOptimizer
from fedloom.weights import Weights


def add_delta(current: Weights, delta: Weights, scale: float = 1.0) -> Weights:
    """``current + scale * delta`` tensor by tensor, in each tensor's own dtype."""
    out = []
    for name, arr in current.items():
        d = delta[name]
        if arr.dtype.kind in "iu":
            step = np.rint(d.astype(np.float64) * scale) if scale != 1.0 else d
            out.append((name, (arr + step.astype(arr.dtype)).astype(arr.dtype)))
        else:
            step = d if scale == 1.0 else d * np.asarray(scale, dtype=arr.dtype)
            if step.dtype == arr.dtype:  # one new array: no temporary, no astype copy
                out.append((name, np.add(arr, step)))
            else:
                out.append((name, (arr + step).astype(arr.dtype)))
    return Weights(out)


class ServerSGD(ServerOptimizer):
    """``w <- w + lr * mean_delta``; with ``lr = 1`` this is FedAvg (McMahan et al., 2017)."""

    def __init__(self, lr: float = 1.0) -> None:
        if not lr > 0:
            raise ConfigError("server_learning_rate", f"must be positive, got {lr}")
        self.lr = lr

    def step(self, current: Weights, mean_delta: Weights) -> Weights:
        return add_delta(current, mean_delta, self.lr)
