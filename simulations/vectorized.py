"""`VectorizedFitter`: a round's sampled clients trained together, in one batched computation.

The clients of a chunk (``chunk_size`` of the round's tasks, in task order) train as a
stack: ``torch.func.vmap`` over the model's ``torch.func.functional_call`` runs every
client's forward pass in one call per local step, one backward pass of their summed
losses gives every client's gradient, and the optimizer updates the whole stack at once
(``_functional_train``).
Each task's `FitOutput` is the one its `TorchClient` (as
`fedloom.simulations.job.Job.make_client` builds it) would return alone, within float
rounding (batched matrix products and the loss sum in another order):

- the same batches in the same order: the client's ``RandomSampler`` permutations,
  reseeded from the fit config's ``seed`` (without one, a per-client generator goes
  on from the run seed, as the cached client's does); shares of different sizes are
  padded, with a mask, and a short last batch averages over its real examples only;
- the same optimizer: SGD with momentum (a fresh buffer per fit, equal to the first
  gradient) or Adam with torch's defaults, bias correction included; a client with
  fewer batches than the others does not step once they are done;
- the same fit config: ``lr`` (else ``eta_l``, else the constructor's ``lr``),
  ``local_epochs``, FedProx's ``proximal_mu`` (term in the loss, metric echoed) and
  ``max_update_norm`` (clipped as `TorchClient` does, metric ``update_norm``); tasks
  of one round may differ in all of them;
- the same metrics: ``train_loss`` (the batch-size-weighted mean task loss over all
  epochs) and ``num_examples`` (examples seen per epoch).

Limits: the loss is cross-entropy over integer labels (`TorchClient`'s default); the
model must train the same under ``vmap``. Models that cannot are refused when the
fitter is built, with a `ConfigError` saying why: buffers that training updates
(batch norm's running statistics), statistics over the batch (every batch norm, with
or without running statistics: a short batch's padding would enter them), randomness
in the forward pass (dropout), data-dependent control flow (a branch on a tensor's
value, ``.item()``), tied parameters. Beyond the known module types, one vmapped
training step on a small batch finds these, and one example's output computed beside
two different neighbours finds a model that mixes the examples of a batch; state a
module keeps in plain Python attributes is not checked. Per-example normalisation
(``LayerNorm``, ``GroupNorm``) trains as alone. The
clients' data lives on the device for the fitter's lifetime; a chunk holds its
parameters and optimizer state once per client. Unlike `TorchClient`, the fitter
leaves torch's global random state alone (a model it accepts draws nothing). Like the
runner's cached clients, it keeps each client's shuffling generator between fits, so
one fitter serves one run.

Example::

    fitter = VectorizedFitter.from_job(job, chunk_size=100)
    history = run_local(strategy, client_fn, job.initial_weights(), num_clients=100,
                        num_rounds=20, fitter=fitter)
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedloom.client_sdk._client import FitOutput
from fedloom.client_sdk.torch_trainer import (
    bound_update,
    load_weights,
    max_update_norm,
    proximal_mu,
    resolve_device,
)
from fedloom.errors import ConfigError
from fedloom.fit_config import (
    CLIENT_LR,
    LEARNING_RATE,
    LOCAL_EPOCHS,
    PROXIMAL_MU,
    SEED,
    UPDATE_NORM,
)
from fedloom.simulations._functional_train import (
    AdamStep,
    ChunkPlan,
    ClientPlan,
    ClientShuffle,
    SgdStep,
    StackedGradients,
    Tensors,
)
from fedloom.simulations.fitting import FitTask
from fedloom.simulations.models import _as_tensors
from fedloom.stacked import WeightsRow, WeightsStack
from fedloom.types import Scalar
from fedloom.weights import Weights

if TYPE_CHECKING:
    from fedloom.simulations.job import ClientData, Job

OPTIMIZERS = ("sgd", "adam")
_USE_LOCAL = 'use engine = "local"'
# BatchNorm1d/2d/3d, their lazy forms and SyncBatchNorm, with or without running
# statistics: in training they all normalise with the statistics of the batch.
_BATCH_STATISTICS = (torch.nn.modules.batchnorm._BatchNorm,)
_DROPOUT = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
            torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)


@dataclasses.dataclass(frozen=True, slots=True)
class _TaskSettings:
    """What one task's fit config asks for, parsed as `TorchClient.fit` parses it."""

    lr: float
    mu: float
    max_norm: float | None
    epochs: int


class VectorizedFitter:
    """Trains each chunk of a round's tasks in one ``vmap``-ed computation.

    Args:
        model: the network every client trains (copied; its weights are replaced by
            each round's global weights).
        clients: each client's data, indexed by partition id.
        batch_size: examples per local step.
        lr: learning rate when the fit config sends none.
        momentum: SGD's momentum (ignored by Adam).
        optimizer: ``"sgd"`` or ``"adam"``.
        local_epochs: passes per fit when the fit config sends no ``local_epochs``.
        seed: the shuffle seed a client starts from when its fit config brings none.
        chunk_size: clients trained at once; bounds the memory of a chunk.
        device: ``"cpu"``, ``"cuda"``, ``"auto"`` (CUDA when available)...

    Raises:
        ConfigError: a setting is out of range, or the model cannot be trained under
            ``vmap`` (the message says why).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        clients: Sequence[ClientData],
        *,
        batch_size: int,
        lr: float,
        momentum: float,
        optimizer: str = "sgd",
        local_epochs: int = 1,
        seed: int = 0,
        chunk_size: int = 64,
        device: str | torch.device = "cpu",
    ) -> None:
        for setting, value in (("batch_size", batch_size), ("local_epochs", local_epochs),
                               ("chunk_size", chunk_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(setting, f"must be an integer >= 1, got {value!r}")
        if isinstance(lr, bool) or not isinstance(lr, int | float) or not (
                math.isfinite(lr) and lr > 0):
            raise ConfigError("lr", f"must be a positive number, got {lr!r}")
        if not 0.0 <= momentum < 1.0:
            raise ConfigError("momentum", f"must be in [0, 1), got {momentum!r}")
        if optimizer not in OPTIMIZERS:
            raise ConfigError("optimizer", f"{optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if not clients:
            raise ConfigError("clients", "needs at least one client's data")
        self.batch_size, self.lr, self.momentum = batch_size, float(lr), float(momentum)
        self.optimizer, self.local_epochs, self.seed = optimizer, local_epochs, seed
        self.chunk_size = chunk_size
        self.device = resolve_device(device)
        self._model = copy.deepcopy(model).to(self.device).train()
        self._names = list(self._model.state_dict())
        self._trainable = _trainable_names(self._model)
        pairs = [_as_tensors(c.x, c.y, f"clients[{i}]") for i, c in enumerate(clients)]
        self._sizes = [len(y) for _, y in pairs]
        self._offsets = np.concatenate([[0], np.cumsum(self._sizes)[:-1]]).tolist()
        self._x: torch.Tensor | None = torch.cat([x for x, _ in pairs]).to(self.device)
        self._y: torch.Tensor | None = torch.cat([y for _, y in pairs]).to(self.device)
        self._shuffles: dict[int, ClientShuffle] = {}
        self._gradients = StackedGradients(self._model, self._trainable)
        self._probe()

    @classmethod
    def from_job(cls, job: Job, *, chunk_size: int = 64,
                 device: str | torch.device | None = None) -> VectorizedFitter:
        """The fitter of ``job``'s clients (`Job.make_client`'s settings); ``device``
        defaults to the scenario's ``client.device``."""
        spec = job.scenario.client
        return cls(job.make_model(), job.clients, batch_size=spec.batch_size, lr=spec.lr,
                   momentum=spec.momentum, optimizer=spec.optimizer,
                   local_epochs=job.scenario.local_epochs, seed=job.scenario.seed,
                   chunk_size=chunk_size, device=device if device is not None else spec.device)

    # -- the RoundFitter contract --------------------------------------------------------
    def fit(self, weights: Weights, tasks: Sequence[FitTask]) -> Iterator[FitOutput | Exception]:
        """One result per task, in task order, a chunk at a time: its `FitOutput`, or
        the exception that task raised (unknown client, bad config)."""
        if self._x is None:
            raise RuntimeError("this VectorizedFitter is closed; build a new one")
        try:
            start = self._start(weights)
        except Exception as exc:  # every client would refuse these weights
            yield from (exc for _ in tasks)
            return
        for begin in range(0, len(tasks), self.chunk_size):
            yield from self._fit_chunk(weights, start, tasks[begin:begin + self.chunk_size])

    def close(self) -> None:
        """Drop the clients' data and the model from the device."""
        self._x = self._y = None
        self._shuffles.clear()
        self._model = self._model.to("cpu")

    # -- one chunk -----------------------------------------------------------------------
    def _start(self, weights: Weights) -> Tensors:
        """The round's weights on the device (checked as `load_weights` checks them)."""
        load_weights(self._model, weights)
        return {k: v.detach() for k, v in self._model.state_dict(keep_vars=True).items()}

    def _fit_chunk(self, weights: Weights, start: Tensors,
                   tasks: Sequence[FitTask]) -> Iterator[FitOutput | Exception]:
        results: list[FitOutput | Exception | None] = [None] * len(tasks)
        positions, plans, settings = [], [], []
        for position, task in enumerate(tasks):
            try:
                task_settings, plan = self._plan(task)
            except Exception as exc:  # a failed client is data, not the end of the round
                results[position] = exc
                continue
            positions.append(position)
            plans.append(plan)
            settings.append(task_settings)
        if plans:
            try:
                outputs: Sequence[FitOutput | Exception] = self._train(
                    weights, start, plans, settings)
            except Exception as exc:
                outputs = [exc] * len(plans)
            for position, output in zip(positions, outputs, strict=True):
                results[position] = output
        for result in results:
            assert result is not None
            yield result

    def _plan(self, task: FitTask) -> tuple[_TaskSettings, ClientPlan]:
        index, config = task.index, task.config
        if not 0 <= index < len(self._sizes):
            raise IndexError(f"no client {index}: partition ids are 0..{len(self._sizes) - 1}")
        shuffle = self._shuffles.get(index)
        if shuffle is None:
            shuffle = self._shuffles[index] = ClientShuffle(self.seed)
        if SEED in config:
            shuffle.reseed(int(config[SEED]))
        epochs = int(config.get(LOCAL_EPOCHS, self.local_epochs))
        if epochs < 1:
            raise ConfigError(LOCAL_EPOCHS, f"must be at least 1, got {epochs}")
        mu, max_norm = proximal_mu(config), max_update_norm(config)
        lr = config.get(LEARNING_RATE, config.get(CLIENT_LR))
        settings = _TaskSettings(self.lr if lr is None else float(lr), mu, max_norm, epochs)
        n = self._sizes[index]
        return settings, ClientPlan(n, self._offsets[index], epochs, shuffle.orders(n, epochs))

    def _train(self, weights: Weights, start: Tensors, plans: Sequence[ClientPlan],
               settings: Sequence[_TaskSettings]) -> list[FitOutput | Exception]:
        assert self._x is not None and self._y is not None
        x_all, y_all, device = self._x, self._y, self.device
        plan = ChunkPlan(plans, self.batch_size)
        ordered = [settings[j] for j in plan.order]
        size = len(plans)
        # Broadcast views of the global model until the first step writes the stack.
        params = [start[k].unsqueeze(0).expand(size, *start[k].shape) for k in self._trainable]
        consts = {k: v for k, v in start.items() if k not in self._trainable}
        dtype = params[0].dtype if params else torch.float32
        step = AdamStep(params) if self.optimizer == "adam" else SgdStep(self.momentum)
        lrs = {task.lr for task in ordered}
        lr: float | torch.Tensor = lrs.pop() if len(lrs) == 1 else torch.tensor(
            [task.lr for task in ordered], dtype=dtype, device=device)
        proximal = None
        if any(task.mu > 0 for task in ordered):
            mus = torch.tensor([task.mu for task in ordered], dtype=dtype, device=device)
            proximal = [start[k] for k in self._trainable], mus
        # The whole chunk's batch layout goes to the device once; each step slices it.
        index = torch.from_numpy(plan.index).to(device)
        mask = torch.from_numpy(plan.mask).to(device=device, dtype=dtype)
        count64 = torch.from_numpy(plan.count).to(device=device, dtype=torch.float64)
        count = count64.to(dtype)
        total = torch.zeros(size, dtype=torch.float64, device=device)
        width = plan.index.shape[2]
        for s, k in enumerate(plan.active):
            rows = index[s, :k].reshape(-1)
            x = x_all.index_select(0, rows).view(k, width, *x_all.shape[1:])
            y = y_all.index_select(0, rows).view(k, width)
            grads, task_loss = self._gradients(
                [p[:k] for p in params], consts, x, y, mask[s, :k], count[s, :k],
                None if proximal is None else (proximal[0], proximal[1][:k]))
            step(params, grads, k, s, lr)
            total[:k] += task_loss.double() * count64[s, :k]
        host = {name: p.cpu().numpy() for name, p in zip(self._trainable, params, strict=True)}
        return self._outputs(weights, host, plan, ordered, total.tolist())

    def _outputs(self, weights: Weights, host: dict[str, np.ndarray], plan: ChunkPlan,
                 ordered: Sequence[_TaskSettings], totals: list[float]
                 ) -> list[FitOutput | Exception]:
        """`FitOutput`s in the chunk's task order from the stack's rows (in plan order)."""
        outputs: list[FitOutput | Exception] = [ValueError("not trained")] * len(ordered)
        size = len(ordered)
        # One stack for the chunk: each client's weights are a row of views, which the
        # engine and the weighted mean handle a stack at a time (fedloom.stacked).
        stack = WeightsStack({
            name: host[name] if name in host
            else np.broadcast_to(weights[name], (size, *weights[name].shape))
            for name in self._names})
        for row, j in enumerate(plan.order):
            settings, seen = ordered[row], int(plan.seen[row])
            try:
                new: Weights = WeightsRow(stack, row)
                metrics: dict[str, Scalar] = {"train_loss": totals[row] / seen}
                if settings.mu > 0:
                    metrics[PROXIMAL_MU] = settings.mu
                if settings.max_norm is not None:
                    new, norm = bound_update(weights, new, settings.max_norm)
                    metrics[UPDATE_NORM] = norm
                outputs[j] = FitOutput(new, seen // settings.epochs, metrics)
            except Exception as exc:
                outputs[j] = exc
        return outputs

    # -- the refusals --------------------------------------------------------------------
    def _probe(self) -> None:
        """Refuse, with the reason, a model whose training ``vmap`` cannot batch."""
        _refuse_known_modules(self._model)
        assert self._x is not None and self._y is not None
        rows = min(2, self._sizes[0])
        start = {k: v.detach() for k, v in self._model.state_dict(keep_vars=True).items()}
        params = [start[k].unsqueeze(0).expand(2, *start[k].shape).clone()
                  for k in self._trainable]
        consts = {k: v for k, v in start.items() if k not in self._trainable}
        x = self._x[:rows].unsqueeze(0).expand(2, *self._x[:rows].shape)
        y = self._y[:rows].unsqueeze(0).expand(2, rows)
        mask = torch.ones(2, rows, device=self.device)
        count = torch.full((2,), float(rows), device=self.device)
        before = {name: b.clone() for name, b in self._model.named_buffers()}
        try:
            self._gradients(params, consts, x, y, mask, count)
            anchor = [start[k] for k in self._trainable]
            self._gradients(params, consts, x, y, mask, count,
                            (anchor, torch.ones(2, device=self.device)))
        except Exception as exc:
            raise ConfigError("model", f"{_why_not_batched(exc)}; {_USE_LOCAL}") from exc
        for name, buffer in self._model.named_buffers():
            if not torch.equal(buffer, before[name]):
                raise ConfigError(
                    "model", f"buffer {name!r} changes during a training step, and "
                    f"vectorized training cannot keep it per client; {_USE_LOCAL}")
        self._probe_mixing(params, consts)

    def _probe_mixing(self, params: list[torch.Tensor], consts: Tensors) -> None:
        """Refuse a model whose output for an example depends on the other examples of
        its batch: a client's short batch is padded with examples the mask weighs 0 in
        the loss, but such a model would see them, and train otherwise than alone.

        Two clients with the same weights get batches that share their first example
        and differ in the second; its logits must not differ.
        """
        assert self._x is not None
        x = self._x
        other = next((j for j in range(2, min(len(x), 256)) if not torch.equal(x[j], x[1])),
                     None)
        if other is None:  # too few distinct examples to tell
            return
        batches = torch.stack([x[[0, 1]], x[[0, other]]])
        with torch.no_grad():
            logits = self._gradients.logits(params, consts, batches)
        if not torch.allclose(logits[0, 0], logits[1, 0], rtol=1e-4, atol=1e-5):
            raise ConfigError(
                "model", "its output for one example changes with the other examples of "
                "its batch (a statistic over the batch?), and vectorized training pads a "
                f"client's short batches with examples it must not see; {_USE_LOCAL}")


def _trainable_names(model: torch.nn.Module) -> list[str]:
    """The trainable parameters, in ``state_dict`` order; refuses tied parameters."""
    state = model.state_dict(keep_vars=True)
    params = dict(model.named_parameters())
    owned = set(params) | {name for name, _ in model.named_buffers()}
    shared = [name for name in state if name not in owned]
    if shared:
        raise ConfigError(
            "model", f"{shared[0]!r} is a parameter shared under several names (tied "
            f"weights), which vectorized training does not stack; {_USE_LOCAL}")
    return [name for name in state if name in params and params[name].requires_grad]


def _refuse_known_modules(model: torch.nn.Module) -> None:
    for name, module in model.named_modules():
        where = f"{type(module).__name__} at {name!r}"
        if getattr(module, "track_running_stats", False) and (
                getattr(module, "running_mean", None) is not None):
            raise ConfigError("model", f"{where} keeps running statistics, which vectorized "
                              f"training cannot update per client; {_USE_LOCAL}")
        if isinstance(module, _BATCH_STATISTICS):
            raise ConfigError("model", f"{where} normalises over the batch, and vectorized "
                              "training pads a client's short batches with examples that "
                              f"would enter those statistics; {_USE_LOCAL}")
        if isinstance(module, _DROPOUT) and module.p > 0:
            raise ConfigError("model", f"{where} draws random masks in training, which "
                              f"vectorized training cannot draw per client; {_USE_LOCAL}")


def _why_not_batched(exc: Exception) -> str:
    text = str(exc)
    if "data-dependent control flow" in text:
        return ("its forward pass branches on a tensor's value or calls .item() "
                "(data-dependent control flow), which one batched step for every client "
                "cannot follow")
    if "random operation" in text:
        return ("its forward pass draws random numbers, which vectorized training cannot "
                "draw as each client would alone")
    if "running_mean" in text:
        return "it keeps running statistics, which vectorized training cannot update per client"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"torch.func.vmap cannot batch its training step ({first})"
