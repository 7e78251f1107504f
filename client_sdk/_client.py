"""The `Client` interface an application implements: train and evaluate on local data.

A client receives the global `Weights` and a config, and returns its new local weights
(`FitOutput`) or an evaluation (`EvaluateOutput`). The SDK turns new weights into the
delta the server aggregates, so a client never computes deltas itself.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import operator

import numpy as np

from fedloom.types import Config, Metrics, validate_record
from fedloom.weights import Weights


@dataclasses.dataclass(frozen=True, slots=True)
class FitOutput:
    """The result of local training: new local weights, examples used, metrics.

    Checked here, so that a wrong one fails its task with a message that says what to
    change, rather than the SDK later: ``weights`` is a `Weights` (wrap a dict of arrays:
    ``Weights(arrays)``), ``num_examples`` a positive int (a numpy integer is taken as
    one), ``metrics`` a record of bool, int, float, str or bytes.
    """

    weights: Weights
    num_examples: int
    metrics: Metrics = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.weights, Weights):
            raise TypeError(f"FitOutput.weights must be a fedloom.weights.Weights, not "
                            f"{type(self.weights).__name__}: wrap the arrays, "
                            "FitOutput(Weights(arrays), num_examples)")
        object.__setattr__(self, "num_examples", _count(self.num_examples, "FitOutput"))
        object.__setattr__(self, "metrics", validate_record(self.metrics, "fit metrics"))


@dataclasses.dataclass(frozen=True, slots=True)
class EvaluateOutput:
    """The result of local evaluation of the global weights.

    Checked as `FitOutput` is: ``loss`` a number (kept as a float: a numpy scalar or a
    one-element tensor is converted), ``num_examples`` a positive int.
    """

    loss: float
    num_examples: int
    metrics: Metrics = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss", _loss(self.loss))
        object.__setattr__(self, "num_examples", _count(self.num_examples, "EvaluateOutput"))
        object.__setattr__(self, "metrics", validate_record(self.metrics, "evaluate metrics"))


def _loss(value: object) -> float:
    """``value`` as a finite float; a bool or a text is not a loss, though float() takes
    them. A NaN or infinite loss (a diverged model) fails the task with a reason here:
    sent, the server would refuse it as a malformed result and strike the client."""
    loss: float | None = None
    try:
        if not isinstance(value, bool | str | bytes):
            loss = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        pass
    if loss is None:
        raise TypeError(f"EvaluateOutput.loss must be a number, not {type(value).__name__} "
                        f"({value!r}): pass the mean loss as float(loss)")
    if not math.isfinite(loss):
        raise ValueError(f"EvaluateOutput.loss is {loss}: the model's loss on this client's "
                         "data is not finite (has it diverged?)")
    return loss


def _count(value: object, owner: str) -> int:
    """``value`` as a positive Python int: a numpy integer (``len`` of an array, a sum)
    counts as an int, a float or a bool does not, whatever its value."""
    # a bool has an __index__ (and np.bool_ had one in older numpy): not a count
    index = None if isinstance(value, bool | np.bool_) else _as_index(value)
    if index is None:
        raise TypeError(f"{owner}.num_examples must be an int, not {type(value).__name__} "
                        f"({value!r}): pass the number of examples as int(n)")
    if index <= 0:
        raise ValueError(f"{owner}.num_examples must be positive, got {index}")
    return index


def _as_index(value: object) -> int | None:
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


class Client(abc.ABC):
    """Implement `fit` and `evaluate`; hand the instance to `start_client`.

    Both methods receive read-only arrays: copy before changing them in place.
    """

    @abc.abstractmethod
    def fit(self, weights: Weights, config: Config) -> FitOutput:
        """Train from ``weights`` on local data and return the new local weights."""

    @abc.abstractmethod
    def evaluate(self, weights: Weights, config: Config) -> EvaluateOutput:
        """Evaluate ``weights`` on local data."""
