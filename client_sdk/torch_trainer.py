"""`TorchClient`: a `Client` built from a ``torch.nn.Module`` and data loaders.

The only module of the SDK that imports torch (install ``fedloom[torch]``). It uses
CUDA when present (``device="auto"``), converts between ``state_dict`` and `Weights`
(parameters and buffers, in ``state_dict`` order), and reads these fit-config keys:

- ``local_epochs`` (int): overrides the constructor's ``local_epochs``, up to its
  ``max_local_epochs`` (more is refused: the task fails, the client carries on);
- ``lr`` or ``eta_l`` (float): sets the learning rate of every parameter group;
- ``proximal_mu`` (float >= 0; Flower's FedProx sends it as ``proximal-mu``, which is
  read too): FedProx's proximal term ``mu/2 * ||w - w_global||^2`` over the parameters
  (Li et al., MLSys 2020). An applied value is reported back as the metric
  ``proximal_mu``, so the server can see a client that ignored it; ``train_loss``
  stays the task loss, without the term;
- ``max_update_norm`` (float > 0): the strategy's update-norm bound, applied here as
  clipping: when the update (new weights minus the received ones) is longer than the
  bound in global L2 norm over the floating-point tensors, it is scaled down to it
  (integer buffers untouched), by the kernel's rule (`fedloom.weights.clip_to_norm`). Under
  secure aggregation the server sees only the sum, so only the client can bound its
  update. The metric ``update_norm`` reports the norm before clipping;
- ``seed`` (int): seeds torch's default generator for the training, for reproducible
  runs (``seed_from_server=False`` ignores it). `fit` restores the generator's state
  afterwards. Randomness your own code draws inside training from torch's default
  generator is then known to whoever chose the seed: draw privacy noise from a
  generator of your own seeded from a secret (``os.urandom``; Opacus: ``secure_mode``).

Example::

    model = torch.nn.Sequential(torch.nn.Linear(64, 10))
    client = TorchClient(model, train_loader, val_loader, local_epochs=1)
    start_client("127.0.0.1:8080", client)
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch.optim import optimizer as torch_optimizer

from fedloom.client_sdk._client import Client, EvaluateOutput, FitOutput
from fedloom.errors import ConfigError
from fedloom.fit_config import (
    CLIENT_LR,
    FLOWER_PROXIMAL_MU,
    LEARNING_RATE,
    LOCAL_EPOCHS,
    MAX_UPDATE_NORM,
    PROXIMAL_MU,
    SEED,
    UPDATE_NORM,
)
from fedloom.types import Config, Scalar
from fedloom.weights import Weights, check_norm_bound, l2_norm, scale_floating

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
Batch = Any


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` picks CUDA when available, else CPU; anything else is passed to torch."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            "device", f"{device!r} is not a torch device ('auto', 'cpu', 'cuda')"
        ) from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "CUDA was requested but torch sees no GPU; use 'auto' or 'cpu'")
    return resolved


def state_dict_to_weights(state: Mapping[str, torch.Tensor]) -> Weights:
    """Copy a ``state_dict`` to host memory as `Weights`, keeping names and order.

    Raises:
        ValueError: a tensor's dtype has no numpy (wire) counterpart, e.g. bfloat16.
    """
    try:
        return Weights((name, t.detach().cpu().numpy().copy()) for name, t in state.items())
    except TypeError as exc:  # torch: "Got unsupported ScalarType BFloat16"
        odd = next((f"{name!r} ({t.dtype})" for name, t in state.items()
                    if not _has_numpy_dtype(t.dtype)), "a tensor")
        raise ValueError(
            f"the model's tensor {odd} cannot be sent: its dtype has no numpy counterpart "
            "(weights travel as float16/32/64 or integers); keep the parameters in float32 "
            "and train in bfloat16 under torch.autocast") from exc


def _has_numpy_dtype(dtype: torch.dtype) -> bool:
    try:
        torch.empty(0, dtype=dtype).numpy()
    except TypeError:
        return False
    return True


def load_weights(module: torch.nn.Module, weights: Weights) -> None:
    """Load `Weights` into ``module`` in place, checking names, shapes and dtypes."""
    state = module.state_dict()
    sources = checked_sources(state, weights)
    with torch.no_grad():
        for tensor, source in zip(state.values(), sources, strict=True):
            tensor.copy_(source)


def checked_sources(state: Mapping[str, torch.Tensor], weights: Weights) -> list[torch.Tensor]:
    """``weights`` as host tensors (copies) in ``state``'s order, after checking that
    they have its names, shapes and dtypes (`load_weights`'s checks).

    Raises:
        ValueError: a name is missing or unexpected, or a shape or dtype differs.
    """
    if list(state) != list(weights):
        missing = [k for k in state if k not in weights]
        extra = [k for k in weights if k not in state]
        raise ValueError(f"weights do not match the model: missing {missing}, unexpected {extra}")
    sources = []
    for name, tensor in state.items():
        arr = weights[name]
        if tuple(arr.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: shape {arr.shape} != model's {tuple(tensor.shape)}")
        source = torch.from_numpy(np.array(arr, copy=True))
        if source.dtype != tensor.dtype:
            raise ValueError(f"{name}: dtype {source.dtype} != model's {tensor.dtype}")
        sources.append(source)
    return sources


def _default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class TorchClient(Client):
    """Train and evaluate a torch model on local loaders.

    Args:
        model: the network; its ``state_dict`` is what travels.
        train_loader: yields ``(inputs, targets)`` batches of local training data.
        val_loader: yields batches for `evaluate`; without one, evaluation uses
            ``train_loader``.
        loss_fn: defaults to cross-entropy (`torch.nn.functional.cross_entropy`).
            `evaluate` reports its mean, and an ``accuracy`` metric when the model
            classifies (see `evaluate_module`).
        optimizer_factory: builds a fresh optimizer per fit (default SGD, lr 0.05,
            momentum 0.9); momentum does not carry over between rounds.
        local_epochs: passes over ``train_loader`` per fit.
        device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        max_local_epochs: the most passes a fit config may ask for (a server asking
            for 10**9 would hold the device for days); more fails the task.
        seed_from_server: seed the training from the fit config's ``seed`` (see the
            module docstring); False draws from the process's generator as it is.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        train_loader: Iterable[Batch],
        val_loader: Iterable[Batch] | None = None,
        *,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        optimizer_factory: OptimizerFactory | None = None,
        local_epochs: int = 1,
        device: str | torch.device = "auto",
        max_local_epochs: int = 100,
        seed_from_server: bool = True,
    ) -> None:
        if local_epochs < 1:
            raise ConfigError("local_epochs", f"must be at least 1, got {local_epochs}")
        if max_local_epochs < local_epochs:
            raise ConfigError("max_local_epochs", f"must be at least local_epochs "
                                                  f"({local_epochs}), got {max_local_epochs}")
        self.device = resolve_device(device)
        # ``Module.to`` walks every submodule even when nothing moves; clients built
        # by the thousand on one shared module (simulations) skip that walk.
        self.model = model if _on_device(model, self.device) else model.to(self.device)
        self.train_loader = train_loader
        self.val_loader = val_loader if val_loader is not None else train_loader
        # The function `torch.nn.CrossEntropyLoss()` calls, without a module per client.
        self.loss_fn = loss_fn or torch.nn.functional.cross_entropy
        self.optimizer_factory = optimizer_factory or _default_optimizer
        self.local_epochs = local_epochs
        self.max_local_epochs = max_local_epochs
        self.seed_from_server = seed_from_server

    def get_weights(self) -> Weights:
        """The model's current weights (e.g. to initialise the server)."""
        return state_dict_to_weights(self.model.state_dict())

    def fit(self, weights: Weights, config: Config) -> FitOutput:
        load_weights(self.model, weights)
        # The server's seed stays inside this fit: the generators it seeds are restored
        # after (unseeded, training draws on from the process's generators, as ever).
        seeded = SEED in config and self.seed_from_server
        with (torch.random.fork_rng(devices=_cuda_devices(self.device)) if seeded
              else contextlib.nullcontext()):
            num_examples, metrics = self.train_in_place(config)
        new_weights = self.get_weights()
        max_norm = max_update_norm(config)
        if max_norm is not None:
            new_weights, norm = bound_update(weights, new_weights, max_norm)
            metrics[UPDATE_NORM] = norm
        return FitOutput(new_weights, num_examples, metrics)

    def train_in_place(self, config: Config) -> tuple[int, dict[str, Scalar]]:
        """`fit`'s training, on the weights the module holds now: the module ends with
        the trained weights (before any ``max_update_norm`` clipping, which needs the
        received weights and is `fit`'s). Returns the examples seen per epoch and the
        metrics (``train_loss``, and ``proximal_mu`` when applied).

        An engine that moves weights in and out of the module itself (a round's clients
        sharing one module, `fedloom.simulations.lean`) calls this instead of `fit`.
        """
        epochs = _whole_epochs(config.get(LOCAL_EPOCHS, self.local_epochs))
        if not 1 <= epochs <= self.max_local_epochs:
            raise ConfigError(LOCAL_EPOCHS, f"must be in 1..{self.max_local_epochs} "
                                            f"(max_local_epochs), got {epochs}")
        if SEED in config and self.seed_from_server:
            _seed(int(config[SEED]), self.device)
        mu = proximal_mu(config)
        max_update_norm(config)  # a bad bound fails before any training
        optimizer = self.optimizer_factory(self.model.parameters())
        lr = config.get(LEARNING_RATE, config.get(CLIENT_LR))
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = float(lr)
        anchor = [p.detach().clone() for p in self.model.parameters()] if mu > 0 else []

        if not all(m.training for m in self.model.modules()):
            self.model.train()  # (a walk of flags is cheaper than train()'s setattrs)
        zero_grad, step = _grad_resetter(optimizer), _stepper(optimizer)
        total_loss, seen = 0.0, 0
        for _ in range(epochs):
            for inputs, targets in self.train_loader:
                inputs, targets = inputs.to(self.device), targets.to(self.device)
                zero_grad()
                task_loss = self.loss_fn(self.model(inputs), targets)
                loss = task_loss
                if mu > 0:
                    prox = sum(
                        (p - a).pow(2).sum()
                        for p, a in zip(self.model.parameters(), anchor, strict=True)
                    )
                    loss = task_loss + 0.5 * mu * prox
                loss.backward()
                step()
                total_loss += float(task_loss.detach()) * len(targets)
                seen += len(targets)
        if seen == 0:
            raise ValueError("train_loader yielded no examples")
        metrics: dict[str, Scalar] = {"train_loss": total_loss / seen}
        if mu > 0:
            metrics[PROXIMAL_MU] = mu
        return seen // epochs, metrics

    def evaluate(self, weights: Weights, config: Config) -> EvaluateOutput:
        """The mean loss over ``val_loader``, with an ``accuracy`` metric only when the
        model classifies (`evaluate_module` says when): a regression reports none."""
        load_weights(self.model, weights)
        loss, accuracy, n = evaluate_module(self.model, self.val_loader, self.loss_fn, self.device)
        return EvaluateOutput(loss, n, {} if accuracy is None else {"accuracy": accuracy})


def _seed(seed: int, device: torch.device) -> None:
    """Seed the generators training on ``device`` draws from: the CPU's, and that CUDA
    device's (the ones `fit` restores), not every device's as `torch.manual_seed` does."""
    torch.random.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


def _cuda_devices(device: torch.device) -> list[int]:
    """The CUDA device whose generator training on ``device`` draws from (none on CPU)."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def _on_device(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether every parameter and buffer of ``model`` is on ``device`` already."""
    return all(t.device == device for t in model.parameters()) and all(
        t.device == device for t in model.buffers())


def _grad_resetter(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """``optimizer.zero_grad(set_to_none=True)``, as a call to make before each step.

    For torch's own ``zero_grad`` (which, with ``set_to_none``, sets each parameter's
    ``grad`` to None inside a profiler range) the parameters are collected once and
    their gradients dropped directly: the same effect, without the per-call wrappers
    that cost as much as a small model's optimizer step. An optimizer that overrides
    ``zero_grad`` has its own called.
    """
    if type(optimizer).zero_grad is not torch.optim.Optimizer.zero_grad:
        return lambda: optimizer.zero_grad(set_to_none=True)
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def drop() -> None:
        for p in params:
            p.grad = None

    return drop


#: torch's optimizers whose ``step`` `_stepper` may call past its wrappers.
_LEAN_STEPS: dict[type[torch.optim.Optimizer], Callable[..., object]] = {
    kind: inspect.unwrap(kind.step)
    for kind in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
}


def _stepper(optimizer: torch.optim.Optimizer) -> Callable[[], object]:
    """``optimizer.step()``, as a call to make after each backward pass.

    torch wraps every optimizer's ``step`` twice: one wrapper opens a profiler range
    and runs the step hooks, the other sets the grad mode and marks two graph breaks
    for ``torch.compile``. For torch's own SGD, Adam and AdamW, with no step hook
    registered (the optimizer's own or global ones), not differentiable, and no
    instance-level ``step`` (an LR scheduler's wrapper), this calls the step's body
    under ``no_grad`` itself: the same update (the same code), without the wrappers,
    which cost a third as much as a small model's update. The conditions are checked at
    every call, so a hook registered later is honoured. Anything else calls ``step``.
    """
    body = _LEAN_STEPS.get(type(optimizer))
    if body is None or optimizer.defaults.get("differentiable", False):
        return optimizer.step
    hooks = (getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
             getattr(torch_optimizer, "_global_optimizer_post_hooks", None),
             getattr(optimizer, "_optimizer_step_pre_hooks", None),
             getattr(optimizer, "_optimizer_step_post_hooks", None))
    if any(h is None for h in hooks):  # another torch: its wrappers may do more
        return optimizer.step

    def lean() -> object:
        if "step" in vars(optimizer) or any(hooks):
            return optimizer.step()
        with torch.no_grad():
            return body(optimizer)

    return lean


def proximal_mu(config: Config) -> float:
    """FedProx's ``mu`` from a fit config (``proximal_mu``, or Flower's ``proximal-mu``)."""
    value = config.get(PROXIMAL_MU, config.get(FLOWER_PROXIMAL_MU, 0.0))
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(PROXIMAL_MU, f"must be a number >= 0, got {value!r}")
    mu = float(value)
    if not (math.isfinite(mu) and mu >= 0):
        raise ConfigError(PROXIMAL_MU, f"must be a number >= 0, got {value!r}")
    return mu


def _whole_epochs(value: object) -> int:
    """A fit config's ``local_epochs`` as an int: 2.7 epochs is refused, not cut to 2."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(LOCAL_EPOCHS, f"must be a whole number of epochs, got {value!r}")
    return value


def max_update_norm(config: Config) -> float | None:
    """The update-norm bound from a fit config, or None when there is none."""
    value = config.get(MAX_UPDATE_NORM)
    return None if value is None else check_norm_bound(value)


def bound_update(received: Weights, new: Weights, max_norm: float) -> tuple[Weights, float]:
    """Clip the update ``new - received`` to global L2 norm ``max_norm``.

    Returns the (possibly) clipped new weights and the update's norm before clipping.
    Integer tensors keep their new values. The norm is the kernel's `l2_norm` of the
    update the SDK uploads (subtracted in each tensor's dtype). The clipped weights are
    ``received + scale * (new - received)``, computed in float64 and rounded once to
    each tensor's dtype; so the result is checked as the server will measure it (a
    float32 delta of the float32 weights): should rounding leave it a hair above the
    bound, it is scaled down a little more, so a server that rejects longer updates
    accepts it.
    """
    norm = l2_norm(new.subtract(received))
    if norm <= max_norm:
        return new, norm
    # the update in float64, exactly as far as float64 holds it (not the rounded upload)
    wide = Weights((k, new[k].astype(np.float64) - b.astype(np.float64))
                   for k, b in received.items() if b.dtype.kind == "f")
    target = max_norm
    clipped = new
    for _ in range(8):
        step = scale_floating(wide, target / norm, keep_dtype=False)
        clipped = Weights(
            (k, (b.astype(np.float64) + step[k]).astype(b.dtype) if k in step else new[k])
            for k, b in received.items()
        )
        actual = l2_norm(clipped.subtract(received))
        if actual <= max_norm:
            break
        target *= (max_norm / actual) * (1 - 1e-6)
    return clipped, norm


def evaluate_module(
    model: torch.nn.Module,
    loader: Iterable[Batch],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
) -> tuple[float, float | None, int]:
    """Mean loss, accuracy and example count over ``loader``.

    The accuracy (the argmax of the outputs against the targets) is None unless every
    batch is a classification (`_classifies`): compared anyway, a regression's (N, 1)
    outputs and targets broadcast to N x N and gave "accuracies" such as 16.0.
    """
    model.eval()
    total_loss, correct, n, classifies = 0.0, 0, 0, True
    with torch.no_grad():
        for inputs, targets in loader:
            inputs, targets = inputs.to(device), targets.to(device)
            outputs = model(inputs)
            total_loss += float(loss_fn(outputs, targets)) * len(targets)
            classifies = classifies and _classifies(outputs, targets)
            if classifies:
                correct += int((outputs.argmax(dim=1) == targets).sum())
            n += len(targets)
    if n == 0:
        raise ValueError("the evaluation loader yielded no examples")
    return total_loss / n, correct / n if classifies else None, n


def _classifies(outputs: torch.Tensor, targets: torch.Tensor) -> bool:
    """Scores of shape (N, C), C >= 2, against integer class labels of shape (N,)."""
    labels = not (targets.dtype.is_floating_point or targets.dtype.is_complex
                  or targets.dtype == torch.bool)
    return (outputs.ndim == 2 and outputs.shape[1] >= 2 and targets.shape == outputs.shape[:1]
            and labels)
