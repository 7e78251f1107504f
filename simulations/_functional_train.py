"""Pieces of `fedloom.simulations.vectorized`: batch plans and functional optimizer steps.

A chunk of clients trains as one stack: every trainable tensor gets a leading client
axis, and step ``s`` trains the clients that still have a batch at ``s``. Clients are
ordered by their number of steps, longest first, so the clients active at a step are
always a prefix ``[:k]`` of the stack: a client that has run out of batches is simply
not in that prefix, and its parameters and optimizer state stay as they were. Every
client trains at step 0 (it has at least one batch), so the stack may start as
broadcast views of the global model: the first step writes new tensors, the later ones
update them in place.

`ChunkPlan` lays out the batches each client's `TorchClient` would draw (the same
``RandomSampler`` + ``BatchSampler`` permutations, `ClientShuffle`), padded to a
common width with a mask, once per chunk; `StackedGradients` gives every active
client's gradient in one forward and one backward pass; `SgdStep` and `AdamStep` apply
``torch.optim.SGD`` and ``torch.optim.Adam`` (their default settings) to the active
prefix of the stack, with the same elementwise operations as torch's single-tensor
implementations, one ``torch._foreach_*`` call per operation for all tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from torch.func import functional_call, vmap
from torch.nn import functional

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

    def orders(self, n: int, epochs: int) -> torch.Tensor:
        """The example order of each of ``epochs`` passes over ``n`` examples, one pass
        after the other: an int64 tensor ``(epochs * n,)``."""
        passes = []
        for _ in range(epochs):
            if self._tail:
                torch.randperm(self._tail, generator=self.generator)
            passes.append(torch.randperm(n, generator=self.generator))
            self._tail = n
        return torch.cat(passes) if epochs > 1 else passes[0]


@dataclasses.dataclass(frozen=True)
class ClientPlan:
    """One client's fit: its examples ``offset .. offset + n`` in the shared data
    tensors, its passes, and the shuffle order of each pass (`ClientShuffle.orders`)."""

    n: int
    offset: int
    epochs: int
    orders: torch.Tensor


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
        size = len(clients)
        n = np.fromiter((c.n for c in clients), np.int64, size)
        epochs = np.fromiter((c.epochs for c in clients), np.int64, size)
        steps = epochs * -(-n // batch_size)
        order = np.argsort(-steps, kind="stable")
        self.order: list[int] = order.tolist()
        ordered = [clients[j] for j in self.order]
        n, epochs, steps = n[order], epochs[order], steps[order]
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
        offsets = np.fromiter((c.offset for c in ordered), np.int64, size)
        # Padding points at row 0 of the data: a real example, weighed 0 by the mask.
        self.index = np.zeros((total, len(ordered), width), np.int64)
        orders = torch.cat([c.orders for c in ordered]).numpy()
        self.index[step, row, column] = orders + offsets[row]
        self.mask = np.zeros((total, len(ordered), width), np.bool_)
        self.mask[step, row, column] = True
        self.count = self.mask.sum(axis=2)
        self.seen = visits
        # steps are descending: the clients with more than s steps are a prefix
        self.active: list[int] = np.searchsorted(
            -steps, -np.arange(total), side="left").tolist()


class StackedGradients:
    """Every active client's loss gradient, for a stack of clients, in one call.

    The forward pass runs under ``vmap`` (``functional_call`` with each client's row of
    the stack); the loss is then computed on the batched logits, and one backward pass
    of the clients' summed losses gives the gradients. Client ``i``'s loss depends on
    row ``i`` of the stack only, so row ``i`` of the gradient of the sum is client
    ``i``'s own gradient (scaled by exactly 1): the values ``vmap(grad(loss))`` gives,
    without its per-call transform of the backward pass.

    The loss is `TorchClient`'s cross-entropy averaged over the batch's real examples
    (padding weighs 0), plus FedProx's ``mu/2 * ||w - w_global||^2`` where asked.
    """

    def __init__(self, model: torch.nn.Module, names: Sequence[str]) -> None:
        self.names = list(names)
        self._model = model
        self._forward = vmap(self._one_client, in_dims=(0, None, 0))

    def _one_client(self, params: Tensors, consts: Tensors, x: torch.Tensor) -> torch.Tensor:
        # No tied weights to untie: the fitter refuses models that have them.
        return functional_call(self._model, (params, consts), (x,), tie_weights=False)

    def logits(self, params: Sequence[torch.Tensor], consts: Tensors,
               x: torch.Tensor) -> torch.Tensor:
        """Every client's logits ``(clients, width, classes)`` for batches ``x``, no loss."""
        return self._forward(dict(zip(self.names, params, strict=True)), consts, x)

    def __call__(self, params: Sequence[torch.Tensor], consts: Tensors, x: torch.Tensor,
                 y: torch.Tensor, mask: torch.Tensor, count: torch.Tensor,
                 proximal: tuple[Sequence[torch.Tensor], torch.Tensor] | None = None,
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The gradients (one per tensor of ``params``, same shapes) and each client's
        task loss (without the proximal term), for batches ``x`` ``(clients, width,
        ...)`` and labels ``y`` ``(clients, width)``; ``proximal`` is the anchor (the
        round's global tensors) and each client's ``mu``."""
        leaves = [p.detach().requires_grad_() for p in params]
        logits = self._forward(dict(zip(self.names, leaves, strict=True)), consts, x)
        # Every example's logits as a column of one (1, classes, examples) input:
        # torch's CPU log-softmax over a short last axis (10 classes) is several times
        # slower than over axis 1 with the examples innermost.
        columns = logits.reshape(-1, logits.shape[-1]).t().unsqueeze(0)
        per_example = functional.cross_entropy(
            columns, y.reshape(1, -1), reduction="none").view_as(y)
        task_loss = (per_example * mask).sum(1) / count
        loss = task_loss
        if proximal is not None:
            anchor, mu = proximal
            distance = sum((p - a).pow(2).reshape(len(p), -1).sum(1)
                           for p, a in zip(leaves, anchor, strict=True))
            loss = task_loss + 0.5 * mu * distance
        grads = torch.autograd.grad(loss.sum(), leaves)
        return list(grads), task_loss.detach()


class SgdStep:
    """``torch.optim.SGD(lr, momentum)`` (no dampening, Nesterov or weight decay) on a
    stack of clients. As in torch, the momentum buffer starts as the first gradient
    (every client of a chunk trains at step 0), so it exists only from the first step on."""

    def __init__(self, momentum: float) -> None:
        self.momentum = momentum
        self.buffers: list[torch.Tensor] | None = None

    def __call__(self, params: list[torch.Tensor], grads: list[torch.Tensor], k: int,
                 step: int, lr: float | torch.Tensor) -> None:
        direction = grads
        if self.momentum:
            if self.buffers is None:  # step 0, every client: the fresh gradients become it
                self.buffers = grads
            else:
                direction = [b[:k] for b in self.buffers]
                torch._foreach_mul_(direction, self.momentum)
                torch._foreach_add_(direction, grads)
        _descend(params, direction, k, step, lr)


class AdamStep:
    """``torch.optim.Adam(lr)`` with torch's defaults (betas 0.9 and 0.999, eps 1e-8,
    bias correction) on a stack of clients. The active clients at step ``s`` (from 0)
    have all taken exactly ``s`` steps before it, so the bias corrections are shared."""

    beta1, beta2, eps = 0.9, 0.999, 1e-8

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.exp_avg = [torch.zeros_like(p) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]

    def __call__(self, params: list[torch.Tensor], grads: list[torch.Tensor], k: int,
                 step: int, lr: float | torch.Tensor) -> None:
        count = step + 1
        correction1 = 1 - self.beta1**count
        correction2_sqrt = (1 - self.beta2**count) ** 0.5
        exp_avg = [m[:k] for m in self.exp_avg]
        exp_avg_sq = [v[:k] for v in self.exp_avg_sq]
        torch._foreach_lerp_(exp_avg, grads, 1 - self.beta1)
        torch._foreach_mul_(exp_avg_sq, self.beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - self.beta2)
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, correction2_sqrt)
        torch._foreach_add_(denom, self.eps)
        if not isinstance(lr, float):
            _descend(params, list(torch._foreach_div(exp_avg, denom)), k, step,
                     lr / correction1)
        elif step == 0:
            params[:] = torch._foreach_addcdiv(params, exp_avg, denom, value=-lr / correction1)
        else:
            torch._foreach_addcdiv_([p[:k] for p in params], exp_avg, denom,
                                    value=-lr / correction1)


def _descend(params: list[torch.Tensor], directions: list[torch.Tensor], k: int, step: int,
             lr: float | torch.Tensor) -> None:
    """``param -= lr * direction`` for the active prefix ``[:k]``: one learning rate, or
    one per client; new tensors at step 0 (see the module docstring), else in place."""
    if isinstance(lr, float):
        if step == 0:
            params[:] = torch._foreach_add(params, directions, alpha=-lr)
        else:
            torch._foreach_add_([p[:k] for p in params], directions, alpha=-lr)
        return
    scaled = [d * lr[:k].view(-1, *([1] * (d.dim() - 1))) for d in directions]
    if step == 0:
        params[:] = torch._foreach_sub(params, scaled)
    else:
        torch._foreach_sub_([p[:k] for p in params], scaled)
