"""`HoldingAggregator`: the base of the robust rules, which need every update at once.

Median, trimmed mean, Krum and Bulyan are not linear: they cannot fold updates into a
running sum, so they hold each round's deltas (as sent, not widened) until `finalize`.
Memory grows with the number of clients; ``holds_all_updates = True`` says so.

They work on deltas, not on client weights. Every rule here is translation-invariant:
the deltas are the client weights minus the same ``current``, so a coordinate-wise
median, a trimmed mean, a pairwise distance ``||Δ_i - Δ_j|| = ||w_i - w_j||``, or a
distance to the coordinate median all give the same selection and the same result
(shifted by ``current``) whichever of the two they see; only float rounding differs.

The robust rules ignore ``num_examples`` when they choose (a client that inflates it
gains nothing) unless a setting says otherwise.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np

from fedloom.errors import AggregationError
from fedloom.strategies._base import Aggregator, MeanUpdate
from fedloom.strategies._mean import cast_like, check_aggregatable
from fedloom.types import ClientUpdate
from fedloom.weights import Weights


class HoldingAggregator(Aggregator):
    """Holds the round's deltas and combines them in `combine` at `finalize`."""

    holds_all_updates = True

    def __init__(self) -> None:
        self._current: Weights | None = None
        self._deltas: list[Weights] = []
        self._num_examples: list[int] = []

    def start(self, current: Weights) -> None:
        check_aggregatable(current)
        self._current = current
        self._deltas = []
        self._num_examples = []

    def accumulate(self, update: ClientUpdate) -> None:
        if self._current is None:
            raise AggregationError("accumulate() called before start()")
        self._current.check_same_layout(update.delta, what=f"update from {update.client_id}")
        self._deltas.append(update.delta)
        self._num_examples.append(update.num_examples)

    def finalize(self) -> MeanUpdate:
        current, deltas, num_examples = self._current, self._deltas, self._num_examples
        self._current, self._deltas, self._num_examples = None, [], []
        if current is None:
            raise AggregationError("finalize() called before start()")
        if not deltas:
            return MeanUpdate(None, 0.0, 0, reason="no updates to aggregate")
        return self.combine(current, deltas, num_examples)

    @abc.abstractmethod
    def combine(
        self, current: Weights, deltas: Sequence[Weights], num_examples: Sequence[int]
    ) -> MeanUpdate:
        """Combine at least one delta into the round's update (or refuse with a reason)."""


def stack(deltas: Sequence[Weights], name: str) -> np.ndarray:
    """The deltas of tensor ``name`` stacked on a new first axis, as float64."""
    return np.stack([d[name].astype(np.float64) for d in deltas])


def per_tensor(current: Weights, values: dict[str, np.ndarray]) -> Weights:
    """Float64 results per tensor, cast back to each tensor's dtype (integers rounded)."""
    return Weights((name, cast_like(ref, values[name])) for name, ref in current.items())


def pairwise_squared_distances(deltas: Sequence[Weights]) -> np.ndarray:
    """``D[i, j] = ||Δ_i - Δ_j||²`` over all tensors, in float64, tensor by tensor.

    Uses ``||x||² + ||y||² - 2 x·y`` on a float64 Gram matrix accumulated one tensor at
    a time (memory: one stacked tensor, not the whole flattened model), clipped at 0.
    """
    n = len(deltas)
    gram = np.zeros((n, n), dtype=np.float64)
    for name in deltas[0]:
        flat = stack(deltas, name).reshape(n, -1)
        gram += flat @ flat.T
    norms = np.diag(gram).copy()
    distances = norms[:, None] + norms[None, :] - 2.0 * gram
    np.maximum(distances, 0.0, out=distances)
    np.fill_diagonal(distances, 0.0)
    return distances
