"""Staleness weighting for buffered asynchronous aggregation (FedBuff).

An update trained on model version ``tau`` and applied to version ``t`` has staleness
``s = t - tau``. FedBuff (Nguyen et al., AISTATS 2022) scales each delta by ``w(s)``
before averaging, so ``mean = sum(n_i * w(s_i) * delta_i) / sum(n_i)`` with the
strategy's weights ``n_i`` (``num_examples``); with equal weights this is the paper's
``(1/K) * sum(w(s_i) * delta_i)``. The weightings are those of FedAsync (Xie et al.,
2019), which FedBuff uses: constant, polynomial ``(1 + s) ** -a`` (the paper's default,
a = 0.5) and hinge (``1`` up to ``b``, then ``1 / (a * (s - b) + 1)``).

Only floating-point tensors are scaled; integer tensors (counters such as
``num_batches_tracked``) keep their delta, as clipping leaves them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import numpy as np

from fedloom._rounds_config import RoundsConfig
from fedloom.errors import ConfigError
from fedloom.strategies._base import aggregator_of, min_updates
from fedloom.types import ClientUpdate
from fedloom.weights import Weights

#: The metric an update in a buffer carries its staleness in.
STALENESS = "staleness"


@dataclasses.dataclass(frozen=True)
class StalenessWeighting:
    """``w(s)``: the factor a delta of staleness ``s`` is scaled by.

    >>> StalenessWeighting("polynomial", exponent=0.5)(3)
    0.5
    >>> StalenessWeighting("hinge", slope=10.0, after=4)(5)
    0.09090909090909091
    """

    kind: str = "polynomial"
    exponent: float = 0.5
    slope: float = 10.0
    after: int = 4

    @classmethod
    def from_config(cls, rounds: RoundsConfig) -> StalenessWeighting:
        return cls(rounds.staleness_weighting, rounds.staleness_exponent, rounds.hinge_slope,
                   rounds.hinge_after)

    def __call__(self, staleness: int) -> float:
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        if self.kind == "constant":
            return 1.0
        if self.kind == "polynomial":
            return float((1.0 + staleness) ** -self.exponent)
        if self.kind == "hinge":
            if staleness <= self.after:
                return 1.0
            return 1.0 / (self.slope * (staleness - self.after) + 1.0)
        raise ValueError(f"unknown staleness weighting {self.kind!r}")


def scale_delta(delta: Weights, factor: float) -> Weights:
    """``delta`` with its floating-point tensors multiplied by ``factor`` (in float64,
    cast back); ``delta`` itself when ``factor`` is 1."""
    if factor == 1.0:
        return delta
    scaled = []
    for name, arr in delta.items():
        value = np.asarray(arr)
        if value.dtype.kind == "f":
            value = (value.astype(np.float64) * factor).astype(value.dtype)
        scaled.append((name, value))
    return Weights(scaled)


def stale_update(update: ClientUpdate, staleness: int,
                 weighting: StalenessWeighting) -> ClientUpdate:
    """``update`` with its delta scaled by ``weighting(staleness)``; the staleness and the
    factor are added to its metrics (``staleness``, ``staleness_weight``)."""
    factor = weighting(staleness)
    metrics = {**update.metrics, STALENESS: staleness, "staleness_weight": factor}
    return ClientUpdate(update.client_id, scale_delta(update.delta, factor),
                        update.num_examples, update.base_round, metrics)


def weighted_updates(updates: Iterable[ClientUpdate],
                     weighting: StalenessWeighting) -> Iterator[ClientUpdate]:
    """A buffer's updates as a strategy aggregates them: each update's metrics carry its
    ``staleness`` (set when it joined the buffer), and its delta is scaled by
    ``weighting`` of it, lazily (one scaled update at a time). The gRPC server and the
    simulation engines both feed ``Strategy.aggregate_fit`` through this."""
    for update in updates:
        yield stale_update(update, int(update.metrics[STALENESS]), weighting)


def holds_all_updates(strategy: object) -> bool:
    """Whether ``strategy``'s aggregator holds every update of a round (a robust rule:
    median, trimmed mean, Krum, Bulyan), seen through a wrapper's ``inner``."""
    aggregator = aggregator_of(strategy)
    return aggregator is not None and aggregator.holds_all_updates


def check_robust_async(strategy: object, rounds: RoundsConfig) -> None:
    """A robust rule in asynchronous rounds needs ``rounds.max_updates_per_client``:
    with no limit one fast client can send every update of every buffer, and the rule
    then chooses among that client's own updates; and a buffer of at least the rule's
    minimum (`Aggregator.min_updates`): every version is a buffer's updates, so a smaller
    one fails them all. `ConfigError` otherwise."""
    if not rounds.asynchronous:
        return
    if holds_all_updates(strategy) and not rounds.max_updates_per_client:
        raise ConfigError(
            "rounds.max_updates_per_client",
            f"{type(strategy).__name__} chooses among a buffer's updates, and with no "
            "limit one fast client can send every update of every buffer (the rule then "
            "picks among that client's own): set it to 1")
    need = min_updates(strategy)
    if rounds.buffer_size < need:
        raise ConfigError(
            "rounds.buffer_size",
            f"is {rounds.buffer_size}, but {type(aggregator_of(strategy)).__name__} needs at "
            f"least {need} updates a version (every version is one buffer's): raise it to "
            f"{need}, or change the strategy's settings")
