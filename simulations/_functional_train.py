"""Pieces of `fedloom.simulations.vectorized`: batch plans and functional optimizer steps.

A chunk of clients trains as one stack: every trainable tensor gets a leading client
axis, and step ``s`` trains the clients that still have a batch at ``s``. Clients are
ordered by their number of steps, longest first, so the clients active at a step are
always a prefix ``[:k]`` of the stack: a client that has run out of batches is simply
not in that prefix, and its parameters and optimizer state stay as they were.

`ChunkPlan` lays out the batches each client's `TorchClient` would draw (the same
``RandomSampler`` + ``BatchSampler`` permutations, `ClientShuffle`), padded to a
common width with a mask; `SgdStep` and `AdamStep` apply ``torch.optim.SGD`` and
``torch.optim.Adam`` (their default settings) to the active prefix of the stack, with
the same elementwise operations as torch's single-tensor implementations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

Tensors = dict[str, torch.Tensor]


class ClientShuffle:
    """The shuffling generator of one client's training loader, and what it draws.

    `fedloom.simulations.models.make_torch_client`'s loader shuffles with
    ``RandomSampler(generator=g)``: each pass draws ``randperm(n)`` and, once
    exhausted, a second ``randperm(n)`` of which it keeps ``num_samples % n`` (here
    none) elements. That tail draw still advances ``g``; it is drawn here only when the
    generator is used again without a reseed (the next pass, or a fit whose config
    brings no seed), since a reseed discards it.
    """

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self._tail = 0

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)
        self._tail = 0

    def orders(self, n: int, epochs: int) -> np.ndarray:
        """The example order of each of ``epochs`` passes over ``n`` examples, as an
        int64 array ``(epochs, n)``."""
        out = np.empty((epochs, n), np.int64)
        for epoch in range(epochs):
            if self._tail:
                torch.randperm(self._tail, generator=self.generator)
            torch.randperm(n, generator=self.generator, out=torch.from_numpy(out[epoch]))
            self._tail = n
        return out


@dataclasses.dataclass(frozen=True)
class ClientPlan:
    """One client's fit: its examples ``offset .. offset + n`` in the shared data
    tensors, its passes, and the shuffle order of each pass."""

    n: int
    offset: int
    epochs: int
    orders: np.ndarray

    def steps(self, batch_size: int) -> int:
        return self.epochs * math.ceil(self.n / batch_size)


class ChunkPlan:
    """The batches of a chunk of clients, step-major, padded to a common width.

    Attributes:
        order: positions of the clients (as given) sorted by steps, longest first;
            row ``j`` of every stacked tensor is client ``order[j]``.
        active: ``active[s]`` is how many clients (a prefix of ``order``) train at step s.
        index: int64 ``(steps, clients, width)``: rows of the shared data tensors.
        mask: bool ``(steps, clients, width)``: True for a real example, False for
            padding.
        count: ``(steps, clients)``: real examples per batch (0 once a client is done).
        seen: examples each client trains on over all its passes (in ``order``).
    """

    def __init__(self, clients: Sequence[ClientPlan], batch_size: int) -> None:
        steps = np.array([c.steps(batch_size) for c in clients])
        self.order = sorted(range(len(clients)), key=lambda j: -steps[j])
        ordered = [clients[j] for j in self.order]
        n = np.array([c.n for c in ordered])
        epochs = np.array([c.epochs for c in ordered])
        width, total = min(batch_size, int(n.max())), int(steps.max())
        # Every example visit of every client, in order: which row, step and column of
        # the batch layout it lands in (a pass's last batch may be short).
        visits = n * epochs
        row = np.repeat(np.arange(len(ordered)), visits)
        first = np.repeat(np.cumsum(visits) - visits, visits)
        position = np.arange(int(visits.sum())) - first
        n_of, per_epoch = n[row], -(-n // batch_size)
        within = position % n_of
        step = (position // n_of) * per_epoch[row] + within // batch_size
        column = within % batch_size
        offsets = np.array([c.offset for c in ordered])
        # Padding points at row 0 of the data: a real example, weighed 0 by the mask.
        self.index = np.zeros((total, len(ordered), width), np.int64)
        self.index[step, row, column] = np.concatenate([c.orders.ravel() for c in ordered]) + (
            offsets[row])
        self.mask = np.zeros((total, len(ordered), width), np.bool_)
        self.mask[step, row, column] = True
        self.count = self.mask.sum(axis=2)
        self.seen = visits
        sorted_steps = steps[self.order]
        self.active = [int((sorted_steps > s).sum()) for s in range(total)]


class SgdStep:
    """``torch.optim.SGD(lr, momentum)`` (no dampening, Nesterov or weight decay) on a
    stack of clients; the momentum buffer starts at zero, so the first step leaves it
    equal to the gradient, as torch's first step does."""

    def __init__(self, params: Tensors, momentum: float) -> None:
        self.momentum = momentum
        self.buffers = {k: torch.zeros_like(v) for k, v in params.items()} if momentum else {}

    def __call__(self, params: Tensors, grads: Tensors, k: int, step: int,
                 lr: float | torch.Tensor) -> None:
        for name, grad in grads.items():
            direction = grad
            if self.momentum:
                direction = self.buffers[name][:k].mul_(self.momentum).add_(grad)
            _descend(params[name][:k], direction, lr)


class AdamStep:
    """``torch.optim.Adam(lr)`` with torch's defaults (betas 0.9 and 0.999, eps 1e-8,
    bias correction) on a stack of clients. The active clients at step ``s`` (from 0)
    have all taken exactly ``s`` steps before it, so the bias corrections are shared."""

    beta1, beta2, eps = 0.9, 0.999, 1e-8

    def __init__(self, params: Tensors) -> None:
        self.exp_avg = {k: torch.zeros_like(v) for k, v in params.items()}
        self.exp_avg_sq = {k: torch.zeros_like(v) for k, v in params.items()}

    def __call__(self, params: Tensors, grads: Tensors, k: int, step: int,
                 lr: float | torch.Tensor) -> None:
        count = step + 1
        correction1 = 1 - self.beta1**count
        correction2_sqrt = (1 - self.beta2**count) ** 0.5
        for name, grad in grads.items():
            exp_avg = self.exp_avg[name][:k].lerp_(grad, 1 - self.beta1)
            exp_avg_sq = self.exp_avg_sq[name][:k]
            exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
            denom = (exp_avg_sq.sqrt() / correction2_sqrt).add_(self.eps)
            if isinstance(lr, float):
                params[name][:k].addcdiv_(exp_avg, denom, value=-lr / correction1)
            else:
                _descend(params[name][:k], exp_avg / denom, lr / correction1)


def _descend(param: torch.Tensor, direction: torch.Tensor, lr: float | torch.Tensor) -> None:
    """``param -= lr * direction`` in place: one learning rate, or one per client."""
    if isinstance(lr, float):
        param.add_(direction, alpha=-lr)
    else:
        param.sub_(direction * lr[: len(param)].view(-1, *([1] * (param.dim() - 1))))
