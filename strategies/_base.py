"""The strategy contract: an Aggregator and a ServerOptimizer composed into a Strategy.

- an **Aggregator** turns one round's client updates into one mean delta:
  ``accumulate(update)`` for each, then ``finalize()``. Linear aggregators keep a
  running sum (constant memory in the number of clients); robust ones hold every update
  and say so with ``holds_all_updates = True``;
- a **ServerOptimizer** applies the mean delta to the global model (SGD with lr 1 is
  FedAvg; momentum, Adagrad, Adam and Yogi give the FedOpt family);
- a **Strategy** adds client selection and the fit/evaluate configuration.

The rule every strategy keeps: its state changes only after the ``updates`` iterable
of `aggregate_fit` is exhausted, so a round aborted mid-stream (the server raises
`RoundAbortedError` from the iterable) leaves the strategy exactly as it was.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from fedloom.errors import AggregationError
from fedloom.types import (
    AggregateResult,
    ClientInfo,
    ClientUpdate,
    EvaluatePlan,
    EvaluateResult,
    FitPlan,
    Metrics,
)
from fedloom.weights import Weights

#: A strategy's checkpointable state: JSON values, with numpy arrays as leaves.
StateDict = dict[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class MeanUpdate:
    """What an aggregator produces: the mean delta (or None and why) and its weight."""

    delta: Weights | None
    total_weight: float
    num_updates: int
    reason: str = ""
    #: True when the delta's arrays are fresh and nobody else holds them: the server
    #: optimizer may write the new weights over them (`ServerOptimizer.step_in_place`).
    owned: bool = False


class Aggregator(abc.ABC):
    """Combines one round's updates; a fresh instance (via `start`) per round."""

    #: True when the aggregator must hold every update (robust rules); False for a stream.
    holds_all_updates: bool = False

    @property
    def min_updates(self) -> int:
        """The fewest updates a round needs for this rule to produce a model (its
        precondition: a round with fewer fails); 1 when any number will do. The server
        warns at start when its ``min_fit_clients`` is below it."""
        return 1

    @abc.abstractmethod
    def start(self, current: Weights) -> None:
        """Begin a round whose updates are deltas from ``current``."""

    @abc.abstractmethod
    def accumulate(self, update: ClientUpdate) -> None:
        """Fold in one validated update (its layout equals ``current``'s)."""

    @abc.abstractmethod
    def finalize(self) -> MeanUpdate:
        """Return the combined delta; the aggregator is then ready for `start` again."""


def aggregator_of(strategy: object) -> Aggregator | None:
    """The `Aggregator` of ``strategy``, seen through wrappers (the update-norm bound,
    differential privacy: each keeps the strategy it wraps as ``inner``), or None."""
    seen = 0
    while not isinstance(getattr(strategy, "aggregator", None), Aggregator):
        strategy = getattr(strategy, "inner", None)
        seen += 1
        if strategy is None or seen > 16:  # a strategy of another kind
            return None
    aggregator: Aggregator = strategy.aggregator  # type: ignore[attr-defined]
    return aggregator


def min_updates(strategy: object) -> int:
    """The fewest updates a round of ``strategy`` needs (`Aggregator.min_updates`; 1
    for a strategy without an aggregator of fedloom's)."""
    aggregator = aggregator_of(strategy)
    return aggregator.min_updates if aggregator is not None else 1


def privacy_spent_metrics(strategy: object) -> dict[str, float]:
    """``privacy_epsilon`` and ``privacy_delta`` spent so far by a private strategy (its
    ``privacy_spent()``); {} for any other."""
    spent = getattr(strategy, "privacy_spent", None)
    if spent is None:
        return {}
    epsilon, delta = spent()
    return {"privacy_epsilon": epsilon, "privacy_delta": delta}


class NonFiniteStepError(AggregationError):
    """A server step would make the global model non-finite; nothing was changed.

    Every value a client sends is finite (the server checks), but finite values can
    still overflow a tensor's dtype in the sum or the step: float32 ends at about
    3.4e38. A round whose step overflows produces no model, and the optimizer keeps
    the state it had (`check_finite_step`).
    """


def non_finite_tensor(weights: Weights) -> str | None:
    """The name of the first floating tensor of ``weights`` holding a NaN or an infinity
    (None: every value is finite). One pass: NaN and infinities carry into a float64 sum,
    and only a sum that overflowed on finite values is checked value by value."""
    for name, arr in weights.items():
        if arr.dtype.kind != "f" or np.isfinite(np.sum(arr, dtype=np.float64)):
            continue
        if not np.isfinite(arr).all():
            return name
    return None


def check_finite_step(weights: Weights, **state: dict[str, np.ndarray]) -> Weights:
    """``weights``, the result of a server step, when every value is finite, and so is
    every buffer of the optimizer's new ``state`` (its moments, by name: a moment that
    overflows freezes or poisons every later step even while the weights stay finite);
    otherwise `NonFiniteStepError`. Optimizers call it before they change their state."""
    name = non_finite_tensor(weights)
    if name is not None:
        raise NonFiniteStepError(
            f"the server step would make tensor {name!r} non-finite (the updates or the "
            f"step overflowed {weights[name].dtype}); the global model and the server "
            "optimizer's state are unchanged")
    for what, buffers in state.items():
        name = non_finite_tensor(Weights(buffers)) if buffers else None
        if name is not None:
            raise NonFiniteStepError(
                f"the server step would make the optimizer's {what} of tensor {name!r} "
                "non-finite (the updates overflowed it); the global model and the server "
                "optimizer's state are unchanged")
    return weights


class ServerOptimizer(abc.ABC):
    """Applies a mean delta (a pseudo-gradient, negated) to the global model."""

    @abc.abstractmethod
    def step(self, current: Weights, mean_delta: Weights) -> Weights:
        """Return the new global weights; this is where optimizer state changes.

        A step whose result is not finite raises `NonFiniteStepError` before it changes
        any state (`check_finite_step`): the round then produces no model.
        """

    def step_in_place(self, current: Weights, mean_delta: Weights) -> Weights:
        """`step` for a mean delta the caller gives up (`MeanUpdate.owned`): the new
        weights may be written over its arrays, saving a model-sized allocation."""
        return self.step(current, mean_delta)

    def state_dict(self) -> StateDict:
        return {}

    def load_state_dict(self, state: StateDict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} has no state, got keys {sorted(state)}")


@runtime_checkable
class Strategy(Protocol):
    """What the server, the Flower bridge and the local engine drive."""

    def configure_fit(
        self, server_round: int, current: Weights, clients: Sequence[ClientInfo]
    ) -> FitPlan: ...

    def aggregate_fit(
        self, server_round: int, current: Weights, updates: Iterable[ClientUpdate]
    ) -> AggregateResult: ...

    def configure_evaluate(
        self, server_round: int, current: Weights, clients: Sequence[ClientInfo]
    ) -> EvaluatePlan: ...

    def aggregate_evaluate(
        self, server_round: int, results: Iterable[EvaluateResult]
    ) -> Metrics: ...

    def state_dict(self) -> StateDict: ...

    def load_state_dict(self, state: StateDict) -> None: ...
