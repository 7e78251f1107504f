"""Small torch models and a `TorchClient` factory for simulations (needs ``fedloom[torch]``).

`make_torch_client` turns numpy arrays into data loaders and a `TorchClient`. The
training loader shuffles with its own ``torch.Generator``; the returned client reseeds
that generator from the fit config's ``seed`` at the start of every fit, so one fit's
batches depend only on (data, weights, config) — not on how many fits the same
object ran before, nor on which process runs it. That is what lets the local engine
and Flower's engine (which builds clients afresh per message) agree round by round.

>>> import numpy as np
>>> client = make_torch_client(np.zeros((8, 64), np.float32), np.zeros(8, np.int64))
>>> list(client.get_weights())
['0.weight', '0.bias', '2.weight', '2.bias']
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from operator import is_

import numpy as np
import torch

from fedloom.client_sdk.torch_trainer import OptimizerFactory, TorchClient, resolve_device
from fedloom.errors import ConfigError
from fedloom.fit_config import SEED
from fedloom.types import Config, Scalar
from fedloom.weights import Weights

DEFAULT_LR = 0.05


def make_mlp(in_features: int = 64, hidden: int = 64, num_classes: int = 10) -> torch.nn.Module:
    """A one-hidden-layer perceptron: Linear → ReLU → Linear (logits).

    With the defaults (digits: 64 inputs, 10 classes) it has 4,810 parameters.
    """
    for name, value in (("in_features", in_features), ("hidden", hidden)):
        if value < 1:
            raise ConfigError(name, f"must be at least 1, got {value}")
    if num_classes < 2:
        raise ConfigError("num_classes", f"must be at least 2, got {num_classes}")
    return torch.nn.Sequential(
        torch.nn.Linear(in_features, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, num_classes),
    )


def initial_weights(model: torch.nn.Module, seed: int) -> Weights:
    """Re-initialise ``model``'s layers from ``seed`` (torch's default init) and return them.

    Uses a forked RNG, so the caller's torch random state is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
    return Weights((k, v.detach().cpu().numpy().copy()) for k, v in model.state_dict().items())


class _SeededTorchClient(TorchClient):
    """A `TorchClient` whose shuffling generator restarts from the fit config's seed.

    Torch's own generators are seeded by `TorchClient` (only those of the device it
    trains on).
    """

    def __init__(self, *args: object, generator: torch.Generator, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.generator = generator
        self._make_optimizer: OptimizerFactory = self.optimizer_factory
        self.optimizer_factory = self._reset_optimizer
        self._optimizer: torch.optim.Optimizer | None = None
        self._held: list[torch.Tensor] = []  # the optimizer's parameters
        self._hyperparameters: list[dict[str, object]] = []

    def _reset_optimizer(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer of the last fit, reset to what a fresh one would be.

        Building a torch optimizer costs about as much as a small model's training
        step; clearing its state (momentum, Adam's moments and step count) and restoring
        its hyperparameters gives the same updates as a new one.
        """
        wanted = list(params)
        optimizer, held = self._optimizer, self._held
        if optimizer is None or len(held) != len(wanted) or not all(map(is_, held, wanted)):
            optimizer = self._optimizer = self._make_optimizer(wanted)
            self._held = [p for group in optimizer.param_groups for p in group["params"]]
            self._hyperparameters = [
                {k: v for k, v in group.items() if k != "params"}
                for group in optimizer.param_groups
            ]
        else:
            optimizer.state.clear()
            for group, saved in zip(optimizer.param_groups, self._hyperparameters, strict=True):
                group.update(saved)
        return optimizer

    def train_in_place(self, config: Config) -> tuple[int, dict[str, Scalar]]:
        try:
            if SEED not in config:
                return super().train_in_place(config)
            self.generator.manual_seed(int(config[SEED]))
            return super().train_in_place(config)  # which seeds torch's generators
        finally:
            if self._optimizer is not None:
                self._optimizer.state.clear()  # no per-client buffers held between fits


class TensorBatches:
    """Batches of ``(x[idx], y[idx])``: the batches ``DataLoader(TensorDataset(x, y),
    sampler=BatchSampler(RandomSampler(..., generator=generator), batch_size,
    drop_last=False), batch_size=None)`` yields, in the same order from the same
    generator state (in order when ``generator`` is None), without the loader's and the
    samplers' per-batch machinery (index lists, fetchers, collation), which costs as
    much as a training step when a fit is a few small batches.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int,
                 generator: torch.Generator | None) -> None:
        self.x, self.y, self.batch_size, self.generator = x, y, batch_size, generator

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x, y, size, generator = self.x, self.y, self.batch_size, self.generator
        n = len(y)
        if generator is None:
            for start in range(0, n, size):
                yield x[start:start + size], y[start:start + size]
            return
        order = torch.randperm(n, generator=generator)
        if n <= size:  # one batch: the whole permutation (index_select: x[order], faster)
            yield x.index_select(0, order), y.index_select(0, order)
        else:
            for start in range(0, n, size):
                batch = order[start:start + size]
                yield x.index_select(0, batch), y.index_select(0, batch)
        # RandomSampler draws a second permutation (for num_samples % n, here none) once
        # the first is used up; drawing it too keeps the generator's sequence the same.
        torch.randperm(n, generator=generator)

    def __len__(self) -> int:
        return -(-len(self.y) // self.batch_size)


def _loader(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, generator: torch.Generator | None
) -> TensorBatches:
    """Whole batches indexed at once; shuffled by ``generator`` when there is one."""
    return TensorBatches(x, y, batch_size, generator)


def _as_tensors(x: np.ndarray, y: np.ndarray, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    xa, ya = np.asarray(x), np.asarray(y)
    if xa.ndim < 2 or ya.ndim != 1 or len(xa) != len(ya) or len(ya) == 0:
        raise ConfigError(
            what, f"need x of (n, ...) and y of (n,), n > 0; got {xa.shape}, {ya.shape}"
        )
    xc = np.ascontiguousarray(xa, dtype=np.float32)
    yc = np.ascontiguousarray(ya, dtype=np.int64)
    # Arrays unpickled from shared memory (Ray) are read-only; torch wants writable ones.
    xc = xc if xc.flags.writeable else xc.copy()
    yc = yc if yc.flags.writeable else yc.copy()
    return torch.from_numpy(xc), torch.from_numpy(yc)


def make_torch_client(
    x: np.ndarray,
    y: np.ndarray,
    *,
    x_val: np.ndarray | None = None,
    y_val: np.ndarray | None = None,
    batch_size: int = 32,
    local_epochs: int = 1,
    lr: float = DEFAULT_LR,
    momentum: float = 0.9,
    seed: int = 0,
    model: torch.nn.Module | None = None,
    hidden: int = 64,
    num_classes: int = 10,
    device: str = "cpu",
    optimizer: str = "sgd",
) -> TorchClient:
    """A `TorchClient` over numpy arrays, training ``model`` (default: `make_mlp`).

    Args:
        x, y: local training data (x float, y integer labels).
        x_val, y_val: local validation data for `evaluate` (default: the training data,
            unshuffled).
        batch_size: examples per step.
        local_epochs: default passes per fit (the fit config's ``local_epochs`` wins).
        lr: learning rate (the fit config's ``lr`` wins).
        momentum: SGD's momentum.
        optimizer: ``"sgd"`` (with ``momentum``) or ``"adam"`` (torch's defaults).
        seed: seeds the model's initial weights and the shuffling generator until a
            fit config brings its own ``seed``.
        model: the network; by default ``make_mlp(x.shape[1], hidden, num_classes)``.
        hidden, num_classes: sizes of the default MLP.
        device: ``"cpu"`` (the default: tiny models train faster there), ``"auto"``...
    """
    if batch_size < 1:
        raise ConfigError("batch_size", f"must be at least 1, got {batch_size}")
    if not lr > 0:
        raise ConfigError("lr", f"must be positive, got {lr}")
    if (x_val is None) != (y_val is None):
        raise ConfigError("x_val/y_val", "give both or neither")
    xt, yt = _as_tensors(x, y, "x/y")
    generator = torch.Generator().manual_seed(seed)
    train_loader = _loader(xt, yt, batch_size, generator)
    if x_val is not None and y_val is not None:
        xv, yv = _as_tensors(x_val, y_val, "x_val/y_val")
    else:
        xv, yv = xt, yt
    # Evaluation never shuffles: its sums then run in one order wherever it runs.
    val_loader = _loader(xv, yv, max(batch_size, 256), None)
    if model is None:
        if xt.ndim != 2:
            raise ConfigError(
                "x", f"the default MLP needs (n, features) inputs, got {tuple(xt.shape)}"
            )
        model = make_mlp(int(xt.shape[1]), hidden, num_classes)
        initial_weights(model, seed)

    if optimizer not in ("sgd", "adam"):
        raise ConfigError("optimizer", f"{optimizer!r} is not one of sgd, adam")

    # torch's own choice of implementation (foreach on CUDA, per tensor on the CPU),
    # made once here instead of at every step.
    foreach = resolve_device(device).type == "cuda"

    def optimizer_factory(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if optimizer == "adam":
            return torch.optim.Adam(params, lr=lr, foreach=foreach)
        return torch.optim.SGD(params, lr=lr, momentum=momentum, foreach=foreach)

    return _SeededTorchClient(
        model,
        train_loader,
        val_loader,
        optimizer_factory=optimizer_factory,
        local_epochs=local_epochs,
        # The limit guards a deployed client from a server; a simulation's clients take
        # their epochs from its own scenario, as the vectorized engine does.
        max_local_epochs=max(local_epochs, 1_000_000),
        device=device,
        generator=generator,
    )
