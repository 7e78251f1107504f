"""How a synchronous round's sampled clients get trained: the `RoundFitter` contract.

The local engine decides *what* each sampled client trains (its `FitTask`: partition id
and fit config, seed included) and a fitter decides *how*: one after another in this
process (`SerialFitter`), spread over worker processes
(`fedloom.simulations.parallel.ParallelFitter`), or all at once in one batched
computation (`fedloom.simulations.vectorized.VectorizedFitter`). Whatever the fitter,
each task's result is what that client would have returned alone, and results come
back in task order, so the strategy aggregates the same updates in the same order.

A fitter yields lazily where it can: the serial one trains a client only when the
engine asks for the next result, so a streaming aggregator holds one update at a time.
A task that fails yields its exception (the engine counts it and leaves it out).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from fedloom.client_sdk._client import Client, FitOutput
from fedloom.types import Config
from fedloom.weights import Weights


@dataclasses.dataclass(frozen=True, slots=True)
class FitTask:
    """One sampled client's work in a round: its partition id and fit config."""

    index: int
    config: Config


class RoundFitter(Protocol):
    """Trains a round's tasks from ``weights``; see the module docstring."""

    def fit(self, weights: Weights, tasks: Sequence[FitTask]) -> Iterator[FitOutput | Exception]:
        """One result per task, in task order: the client's `FitOutput`, or the
        exception it raised."""
        ...

    def close(self) -> None:
        """Release what the fitter holds (worker processes, device memory)."""
        ...


class SerialFitter:
    """Each task on its `Client` in turn, in this process (the reference fitter)."""

    def __init__(self, client_fn: Callable[[int], Client]) -> None:
        self.client_fn = client_fn

    def fit(self, weights: Weights, tasks: Sequence[FitTask]) -> Iterator[FitOutput | Exception]:
        for task in tasks:
            try:
                yield self.client_fn(task.index).fit(weights, task.config)
            except Exception as exc:  # a failed client is data, not the end of the round
                yield exc

    def close(self) -> None:
        return None
