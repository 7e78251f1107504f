"""`LeanFitter`: the local engine's fitter for `TorchClient`s that take turns on one module.

`SerialFitter` hands each client the round's `Weights` and takes new ones back, so
every fit converts the weights from numpy into the module and back (a ``state_dict``
walk and a copy each way, with the layout checked both times), and the engine then
subtracts and folds each update on its own. When a round's clients train the same
module one after another (as `fedloom simulate` builds them), that work can be done
once per round or once per chunk of clients instead:

- the round's weights are checked against the module once (as `load_weights` checks
  them) and kept as tensors; each fit starts by copying them into the module's own
  tensors;
- each client trains with its own `TorchClient.train_in_place`, the code
  `TorchClient.fit` runs: the same batches, seeding, optimizer, FedProx term and
  metrics;
- its trained tensors are copied into its row of the chunk's `WeightsStack`
  (`fedloom.stacked`), so the engine subtracts the round's weights from a whole chunk
  with one operation per tensor, and the weighted mean folds the chunk with one
  product per tensor.

Each `FitOutput` equals what the client's `TorchClient.fit` returns, bit for bit
(weights, example count, metrics, ``max_update_norm`` clipping included). The
aggregate differs from folding every update on its own only in the order of its
float64 sums.

A chunk's rows take at most ``chunk_bytes`` (and hold at least one client); a chunk's
results are yielded once all of its clients have trained. A client that is not a
`TorchClient` runs its own ``fit``, as under `SerialFitter`. The module's tensors must
remain the same tensor objects while a client trains (torch's modules and optimizers
update them in place); a chunk whose training replaced one fails every task in it,
saying so.

Example::

    fitter = LeanFitter(client_fn)  # client_fn(i) -> TorchClient, one shared module
    history = run_local(strategy, client_fn, initial, num_clients=100, num_rounds=20,
                        fitter=fitter)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import numpy as np
import torch

from fedloom.client_sdk._client import Client, FitOutput
from fedloom.client_sdk.torch_trainer import (
    TorchClient,
    bound_update,
    checked_sources,
    max_update_norm,
)
from fedloom.fit_config import UPDATE_NORM
from fedloom.simulations.fitting import FitTask
from fedloom.stacked import WeightsRow, WeightsStack
from fedloom.types import Scalar
from fedloom.weights import Weights

#: A chunk's stack holds at most this many bytes of trained weights (one client at least).
CHUNK_BYTES = 64 * 2**20


class _Start:
    """A module's tensors (in ``state_dict`` order) and the round's values for them,
    checked as `load_weights` checks them; `load` copies the values in, `store` copies
    the trained tensors out into a chunk's rows.

    On the CPU both copies go through numpy views of the tensors, without torch's
    per-call dispatch (they cost as much as the rest of a small model's fit). Writing
    a parameter through its view does not bump its autograd version counter, which
    only guards tensors saved by a live graph: none is alive between two fits.
    """

    __slots__ = ("tensors", "values", "views")

    def __init__(self, module: torch.nn.Module, weights: Weights) -> None:
        state = module.state_dict(keep_vars=True)
        self.tensors = list(state.values())
        self.values = [source.to(t.device) for source, t in zip(
            checked_sources(state, weights), self.tensors, strict=True)]
        self.views: list[tuple[np.ndarray, np.ndarray]] | None = None
        if all(t.device.type == "cpu" for t in self.tensors):
            self.views = [(t.detach().numpy(), v.numpy())
                          for t, v in zip(self.tensors, self.values, strict=True)]

    def load(self) -> None:
        if self.views is not None:
            for view, host in self.views:
                np.copyto(view, host)
            return
        with torch.no_grad():
            for tensor, value in zip(self.tensors, self.values, strict=True):
                tensor.copy_(value)

    def store(self, rows: Sequence[np.ndarray], row: int) -> None:
        if self.views is not None:
            for out, (view, _host) in zip(rows, self.views, strict=True):
                out[row] = view
            return
        for out, tensor in zip(rows, self.tensors, strict=True):
            out[row] = tensor.detach().cpu().numpy()


class LeanFitter:
    """Trains each task on its `TorchClient`, moving weights in and out of the modules
    itself (see the module docstring).

    Args:
        client_fn: client ``index``'s `Client`: a `TorchClient` (clients may share a
            module, the point of this fitter, or have their own), or any other client,
            which runs its own ``fit``.
        chunk_bytes: the most bytes of trained weights a chunk holds before the engine
            takes them.

    Raises:
        ValueError: ``chunk_bytes`` is below 1.
    """

    def __init__(self, client_fn: Callable[[int], Client], *,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be an integer >= 1, got {chunk_bytes!r}")
        self.client_fn, self.chunk_bytes = client_fn, chunk_bytes
        self._round: Weights | None = None
        self._starts: dict[torch.nn.Module, _Start] = {}

    # -- the RoundFitter contract ------------------------------------------------------
    def fit(self, weights: Weights, tasks: Sequence[FitTask]) -> Iterator[FitOutput | Exception]:
        """One result per task, in task order, a chunk at a time: its `FitOutput`, or
        the exception that task raised."""
        rows = rows_within(self.chunk_bytes, weights)
        for begin in range(0, len(tasks), rows):
            part = tasks[begin:begin + rows]
            yield from chunk_outputs(weights, part, self.train_chunk(weights, part))

    def close(self) -> None:
        """Drop the round's weights (the clients belong to ``client_fn``)."""
        self._round, self._starts = None, {}

    # -- chunks ------------------------------------------------------------------------
    def train_chunk(self, weights: Weights, tasks: Sequence[FitTask]) -> TrainedChunk:
        """Train ``tasks`` from ``weights``, one after another; `chunk_outputs` makes
        their results. A client that is not a `TorchClient` runs its own ``fit``."""
        if weights is not self._round:
            self._round, self._starts = weights, {}
        arrays = {spec.name: np.empty((len(tasks), *spec.shape), spec.dtype)
                  for spec in weights.specs()}
        rows = list(arrays.values())
        records: list[Trained | FitOutput | Exception] = []
        used: dict[torch.nn.Module, _Start] = {}
        row_modules: list[torch.nn.Module] = []  # the module each row was trained on
        row = 0
        for task in tasks:
            try:
                client = self.client_fn(task.index)
                if not isinstance(client, TorchClient):
                    records.append(client.fit(weights, task.config))
                    continue
                start = used[client.model] = self._start(client.model, weights)
                start.load()
                seen, metrics = client.train_in_place(task.config)
                start.store(rows, row)
            except Exception as exc:  # a failed client is data, not the end of the round
                records.append(exc)
                continue
            records.append(Trained(row, seen, metrics))
            row_modules.append(client.model)
            row += 1
        stale: dict[torch.nn.Module, RuntimeError] = {}
        for module, start in used.items():
            try:
                _check_same_tensors(module, start)
            except RuntimeError as exc:  # its rows were read from tensors it dropped
                stale[module] = exc
                self._starts.pop(module, None)  # the next chunk walks the module afresh
        if stale:
            records = [stale.get(row_modules[r.row], r) if isinstance(r, Trained) else r
                       for r in records]
        return TrainedChunk({k: v[:row] for k, v in arrays.items()} if row else None, records)

    def _start(self, module: torch.nn.Module, weights: Weights) -> _Start:
        """The module's `_Start` for this round (the weights checked once per round and
        module)."""
        start = self._starts.get(module)
        if start is None:
            start = self._starts[module] = _Start(module, weights)
        return start


def rows_within(chunk_bytes: int, weights: Weights) -> int:
    """How many clients' copies of ``weights`` fit in ``chunk_bytes`` (one at least)."""
    return max(1, chunk_bytes // max(1, weights.nbytes))


class Trained(NamedTuple):
    """A task trained into row ``row`` of its chunk."""

    row: int
    num_examples: int
    metrics: dict[str, Scalar]


@dataclasses.dataclass(frozen=True)
class TrainedChunk:
    """A chunk's training: the trained rows (``arrays[name][row]``; None when no task
    trained) and one record per task, in task order: a `Trained` row, the `FitOutput`
    of a client that fitted itself, or the exception the task raised."""

    arrays: dict[str, np.ndarray] | None
    records: list[Trained | FitOutput | Exception]


def chunk_outputs(weights: Weights, tasks: Sequence[FitTask], chunk: TrainedChunk
                  ) -> Iterator[FitOutput | Exception]:
    """Each task's result from its chunk: trained rows become rows of one `WeightsStack`
    (clipped here when the task's config asks for ``max_update_norm``)."""
    stack = (WeightsStack(chunk.arrays, row_specs=weights.specs())
             if chunk.arrays is not None else None)
    for task, record in zip(tasks, chunk.records, strict=True):
        if not isinstance(record, Trained):
            yield record
            continue
        assert stack is not None
        try:
            new: Weights = WeightsRow(stack, record.row)
            metrics = record.metrics
            max_norm = max_update_norm(task.config)
            if max_norm is not None:
                new, norm = bound_update(weights, new, max_norm)
                metrics[UPDATE_NORM] = norm
            yield FitOutput(new, record.num_examples, metrics)
        except Exception as exc:
            yield exc


def _check_same_tensors(module: torch.nn.Module, start: _Start) -> None:
    """Refuse a chunk whose training replaced one of the module's tensors: its rows
    were read from the tensors the round started with."""
    state = module.state_dict(keep_vars=True)
    held = start.tensors
    if len(state) != len(held) or any(
            a is not b for a, b in zip(state.values(), held, strict=True)):
        changed = [k for k, t in state.items() if not any(t is h for h in held)]
        raise RuntimeError(f"training replaced the module's tensors {changed} instead of "
                           "updating them in place, which LeanFitter cannot follow "
                           "(use SerialFitter)")
