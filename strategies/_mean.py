"""Streaming weighted mean of client deltas (FedAvg's aggregator).

Keeps one float64 running sum per tensor, so memory is constant in the number of
clients (FedJAX keeps "a running weighted mean of client updates ... to avoid loading
all the client outputs into memory"; so do we). Each update is weighted by its
``num_examples``.
"""

from __future__ import annotations

import numpy as np

from fedloom.errors import AggregationError
from fedloom.strategies._base import Aggregator, MeanUpdate
from fedloom.types import ClientUpdate
from fedloom.weights import Weights


def check_aggregatable(current: Weights) -> None:
    """Refuse layouts the delta rules cannot handle (boolean tensors)."""
    for name, arr in current.items():
        if arr.dtype == np.bool_:
            raise AggregationError(
                f"tensor {name!r} is boolean: a delta of booleans has no meaning; "
                "send it as an integer or float tensor, or keep it out of the model weights"
            )


def cast_like(reference: np.ndarray, value64: np.ndarray) -> np.ndarray:
    """Cast a float64 result to ``reference``'s dtype: integers round half to even."""
    if reference.dtype.kind in "iu":
        return np.rint(value64).astype(reference.dtype)
    return value64.astype(reference.dtype, copy=False)


class WeightedMeanAggregator(Aggregator):
    """Weighted mean of deltas by ``num_examples``, as a stream (float64 sums)."""

    holds_all_updates = False

    def __init__(self) -> None:
        self._current: Weights | None = None
        self._sums: dict[str, np.ndarray] = {}
        self._total = 0.0
        self._count = 0

    def start(self, current: Weights) -> None:
        check_aggregatable(current)
        self._current = current
        self._sums = {}
        self._total = 0.0
        self._count = 0

    def accumulate(self, update: ClientUpdate) -> None:
        if self._current is None:
            raise AggregationError("accumulate() called before start()")
        self._current.check_same_layout(update.delta, what=f"update from {update.client_id}")
        weight = float(update.num_examples)
        for name, delta in update.delta.items():
            acc = self._sums.get(name)
            if acc is None:
                acc = self._sums[name] = np.zeros(delta.shape, dtype=np.float64)
            # One float64 temporary of this tensor at a time; the sum stays exact to f64.
            acc += np.multiply(delta, weight, dtype=np.float64)
        self._total += weight
        self._count += 1

    def finalize(self) -> MeanUpdate:
        current, sums, total, count = self._current, self._sums, self._total, self._count
        self._current, self._sums = None, {}
        if current is None:
            raise AggregationError("finalize() called before start()")
        if count == 0:
            return MeanUpdate(None, 0.0, 0, reason="no updates to aggregate")
        mean = Weights(
            (name, cast_like(ref, np.divide(sums[name], total, out=sums[name])))
            for name, ref in current.items()
        )
        return MeanUpdate(mean, total, count)
