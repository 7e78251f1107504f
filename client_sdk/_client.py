"""The `Client` interface an application implements: train and evaluate on local data.

A client receives the global `Weights` and a config, and returns its new local weights
(`FitOutput`) or an evaluation (`EvaluateOutput`). The SDK turns new weights into the
delta the server aggregates, so a client never computes deltas itself.
"""

from __future__ import annotations

import abc
import dataclasses

from fedloom.types import Config, Metrics, validate_record
from fedloom.weights import Weights


@dataclasses.dataclass(frozen=True, slots=True)
class FitOutput:
    """The result of local training: new local weights, examples used, metrics.

    Checked here, so that a wrong one fails its task with a message that says what to
    change, rather than the SDK later: ``weights`` is a `Weights` (wrap a dict of arrays:
    ``Weights(arrays)``), ``num_examples`` a positive int, ``metrics`` a record of bool,
    int, float, str or bytes.
    """

    weights: Weights
    num_examples: int
    metrics: Metrics = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.weights, Weights):
            raise TypeError(f"FitOutput.weights must be a fedloom.weights.Weights, not "
                            f"{type(self.weights).__name__}: wrap the arrays, "
                            "FitOutput(Weights(arrays), num_examples)")
        if isinstance(self.num_examples, bool) or not isinstance(self.num_examples, int):
            raise TypeError("FitOutput.num_examples must be an int")
        if self.num_examples <= 0:
            raise ValueError(f"FitOutput.num_examples must be positive, got {self.num_examples}")
        object.__setattr__(self, "metrics", validate_record(self.metrics, "fit metrics"))


@dataclasses.dataclass(frozen=True, slots=True)
class EvaluateOutput:
    """The result of local evaluation of the global weights."""

    loss: float
    num_examples: int
    metrics: Metrics = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_examples <= 0:
            raise ValueError(
                f"EvaluateOutput.num_examples must be positive, got {self.num_examples}"
            )
        object.__setattr__(self, "metrics", validate_record(self.metrics, "evaluate metrics"))


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
