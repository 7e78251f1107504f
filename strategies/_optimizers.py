"""Server optimizers: how a mean delta moves the global model."""

from __future__ import annotations

import numpy as np

from fedloom.errors import ConfigError
from fedloom.strategies._base import ServerOptimizer, check_finite_step
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
        return check_finite_step(add_delta(current, mean_delta, self.lr))

    def step_in_place(self, current: Weights, mean_delta: Weights) -> Weights:
        """``lr * delta + w`` written over each float delta of the model's own dtype
        (the same values as `step`: one rounding of ``w + lr * delta``)."""
        out = []
        for name, arr in current.items():
            d = mean_delta[name]
            if (arr.dtype.kind == "f" and isinstance(d, np.ndarray) and d.dtype == arr.dtype
                    and d.shape == arr.shape and d.flags.writeable):
                if self.lr != 1.0:
                    np.multiply(d, np.asarray(self.lr, dtype=arr.dtype), out=d)
                out.append((name, np.add(arr, d, out=d)))
            else:
                out.append((name, add_delta(Weights({name: arr}), Weights({name: d}),
                                            self.lr)[name]))
        return check_finite_step(Weights(out))
