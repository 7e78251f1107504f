"""The strategy experiments' building blocks, shared by `benchmarks/strategies.py` (the
full runs) and `tests/strategies/test_strategy_poisoning.py` (a fast version).

- data: scikit-learn's digits through `fedloom.simulations` (`Scenario` -> `Job`:
  a stratified train/test split, an IID or Dirichlet partition, the MLP clients);
- a numpy model, `SoftmaxRegressionClient` (multinomial logistic regression), for the
  fast test: a fit costs tens of microseconds instead of milliseconds;
- attackers, as `Client` wrappers around an honest client (what a compromised device
  running our SDK could send):
  `SignFlipClient` sends ``-10`` times its honest delta; `NoiseClient` sends Gaussian
  noise with the norm of that sign-flipped delta (ten times the honest delta's norm);
  `InflateClient` trains on shifted labels (``y -> (y + 1) mod 10``, a plausible-looking
  update of honest size) and claims ``inflate_factor`` times its examples, so a mean
  weighted by ``num_examples`` gives it almost all the weight;
- `run_experiment`: one run on `fedloom.simulations.run_local`, returning the `History`;
  `rounds_to_reach` and `final_accuracy` read it.

Every run is a pure function of its arguments (seeded partition, initial weights,
per-client per-round seeds from the local engine, seeded noise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Literal

import numpy as np

from fedloom.client_sdk._client import Client, EvaluateOutput, FitOutput
from fedloom.simulations.history import History, RoundRecord
from fedloom.simulations.job import ClientData, Job
from fedloom.simulations.local_engine import run_local
from fedloom.simulations.scenario import ClientSpec, ModelSpec, PartitionSpec, Scenario
from fedloom.strategies import Strategy
from fedloom.types import Config, Scalar
from fedloom.weights import Weights

Attack = Literal["none", "sign_flip", "noise", "inflate"]
ATTACKS: tuple[Attack, ...] = ("none", "sign_flip", "noise", "inflate")
ModelKind = Literal["mlp", "softmax"]


# -- attackers ---------------------------------------------------------------------------

def _delta(new: Weights, base: Weights) -> dict[str, np.ndarray]:
    return {k: new[k].astype(np.float64) - base[k].astype(np.float64) for k in base}


def _apply(base: Weights, delta: dict[str, np.ndarray]) -> Weights:
    return Weights((k, (base[k].astype(np.float64) + delta[k]).astype(base[k].dtype))
                   for k in base)


def _norm(delta: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum(d * d)) for d in delta.values()))


class SignFlipClient(Client):
    """Trains honestly, then sends ``scale`` times its delta (``scale = -10``: the update
    points the other way and is ten times as long)."""

    def __init__(self, inner: Client, scale: float = -10.0) -> None:
        self.inner = inner
        self.scale = scale

    def fit(self, weights: Weights, config: Config) -> FitOutput:
        out = self.inner.fit(weights, config)
        delta = {k: self.scale * d for k, d in _delta(out.weights, weights).items()}
        return FitOutput(_apply(weights, delta), out.num_examples, out.metrics)

    def evaluate(self, weights: Weights, config: Config) -> EvaluateOutput:
        return self.inner.evaluate(weights, config)


class NoiseClient(Client):
    """Trains honestly, then sends Gaussian noise whose global L2 norm is ``norm_factor``
    times the honest delta's (10: the norm of the sign-flipped update). Seeded by the fit
    config's ``seed``, so runs repeat."""

    def __init__(self, inner: Client, norm_factor: float = 10.0) -> None:
        self.inner = inner
        self.norm_factor = norm_factor

    def fit(self, weights: Weights, config: Config) -> FitOutput:
        out = self.inner.fit(weights, config)
        honest = _norm(_delta(out.weights, weights))
        rng = np.random.default_rng(int(config.get("seed", 0)) + 7_919)
        noise = {k: rng.normal(size=np.shape(weights[k])) for k in weights}
        scale = self.norm_factor * honest / max(_norm(noise), 1e-12)
        return FitOutput(_apply(weights, {k: scale * n for k, n in noise.items()}),
                         out.num_examples, out.metrics)

    def evaluate(self, weights: Weights, config: Config) -> EvaluateOutput:
        return self.inner.evaluate(weights, config)


class InflateClient(Client):
    """Claims ``inflate_factor`` times the examples it trained on. Wrap a client built
    on poisoned data (`shift_labels`): its update is of honest size, only its weight in
    an examples-weighted mean is inflated."""

    def __init__(self, inner: Client, inflate_factor: int = 100) -> None:
        self.inner = inner
        self.inflate_factor = inflate_factor

    def fit(self, weights: Weights, config: Config) -> FitOutput:
        out = self.inner.fit(weights, config)
        return FitOutput(out.weights, out.num_examples * self.inflate_factor, out.metrics)

    def evaluate(self, weights: Weights, config: Config) -> EvaluateOutput:
        return self.inner.evaluate(weights, config)


def shift_labels(data: ClientData, num_classes: int) -> ClientData:
    """The same inputs with every label moved to the next class (a label-flip poison)."""
    return dataclasses.replace(data, y=(data.y + 1) % num_classes)


# -- a numpy model for fast runs -----------------------------------------------------------

class SoftmaxRegressionClient(Client):
    """Multinomial logistic regression trained with minibatch SGD, in numpy.

    Weights ``{"weight": (classes, features), "bias": (classes,)}`` (float32, torch's
    ``Linear`` layout). Reads the fit-config keys `TorchClient` reads: ``lr`` /
    ``eta_l``, ``local_epochs``, ``proximal_mu`` (echoed back), ``seed``.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, num_classes: int, *, lr: float = 0.5,
                 batch_size: int = 32, local_epochs: int = 1) -> None:
        self.x = np.asarray(x, np.float64)
        self.y = np.asarray(y, np.int64)
        self.num_classes = num_classes
        self.lr = lr
        self.batch_size = batch_size
        self.local_epochs = local_epochs

    @staticmethod
    def initial_weights(num_features: int, num_classes: int, seed: int) -> Weights:
        rng = np.random.default_rng(seed)
        bound = 1.0 / math.sqrt(num_features)
        return Weights({
            "weight": rng.uniform(-bound, bound, (num_classes, num_features)).astype(np.float32),
            "bias": np.zeros(num_classes, np.float32),
        })

    def fit(self, weights: Weights, config: Config) -> FitOutput:
        w = weights["weight"].astype(np.float64)
        b = weights["bias"].astype(np.float64)
        w0, b0 = w.copy(), b.copy()
        lr = float(config.get("lr", config.get("eta_l", self.lr)))
        mu = float(config.get("proximal_mu", 0.0))
        epochs = int(config.get("local_epochs", self.local_epochs))
        rng = np.random.default_rng(int(config.get("seed", 0)))
        n = len(self.y)
        onehot = np.eye(self.num_classes)[self.y]
        loss_sum = 0.0
        for _ in range(epochs):
            order = rng.permutation(n)
            for start in range(0, n, self.batch_size):
                idx = order[start:start + self.batch_size]
                xb = self.x[idx]
                p = _softmax(xb @ w.T + b)
                loss_sum += -float(np.sum(np.log(p[np.arange(len(idx)), self.y[idx]] + 1e-12)))
                g = (p - onehot[idx]) / len(idx)
                gw, gb = g.T @ xb, g.sum(axis=0)
                if mu > 0:
                    gw += mu * (w - w0)
                    gb += mu * (b - b0)
                w -= lr * gw
                b -= lr * gb
        metrics: dict[str, Scalar] = {"train_loss": loss_sum / (n * epochs)}
        if mu > 0:
            metrics["proximal_mu"] = mu
        new = Weights({"weight": w.astype(np.float32), "bias": b.astype(np.float32)})
        return FitOutput(new, n, metrics)

    def evaluate(self, weights: Weights, config: Config) -> EvaluateOutput:
        loss, accuracy = softmax_evaluate(weights, self.x, self.y)
        return EvaluateOutput(loss, len(self.y), {"accuracy": accuracy})


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def softmax_evaluate(weights: Weights, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Cross-entropy and accuracy of the softmax-regression ``weights`` on ``(x, y)``."""
    w = weights["weight"].astype(np.float64)
    b = weights["bias"].astype(np.float64)
    if not (np.isfinite(w).all() and np.isfinite(b).all()):
        return float("inf"), 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        p = _softmax(np.asarray(x, np.float64) @ w.T + b)
    loss = -float(np.mean(np.log(p[np.arange(len(y)), y] + 1e-12)))
    return loss, float(np.mean(p.argmax(axis=1) == y))


# -- runs ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Setup:
    """One experiment's federation: data partition, clients and their training.

    Args:
        num_clients: clients holding shares of the digits training split.
        partition: ``"iid"`` or ``"dirichlet"`` (label skew, Dirichlet ``alpha``).
        alpha: the Dirichlet concentration (``partition = "dirichlet"``).
        min_size: the fewest examples a Dirichlet share may hold.
        seed: seeds the split, the partition, the initial model and every fit.
        model: ``"mlp"`` (`fedloom.simulations` MLP, torch) or ``"softmax"`` (numpy).
        hidden: the MLP's hidden width.
        batch_size: local minibatch size.
        lr: client learning rate (FedOpt's ``eta_l`` replaces it when sent).
        momentum: client SGD momentum (MLP only).
        local_epochs: passes over local data per fit.
        num_attackers: the last ``num_attackers`` clients attack (when an attack is set).
        attack_scale: `SignFlipClient`'s factor; `NoiseClient` uses ``abs`` of it.
        inflate_factor: `InflateClient`'s factor on ``num_examples``.
    """

    num_clients: int = 20
    partition: Literal["iid", "dirichlet"] = "iid"
    alpha: float = 0.1
    min_size: int = 5
    seed: int = 0
    model: ModelKind = "mlp"
    hidden: int = 64
    batch_size: int = 16
    lr: float = 0.05
    momentum: float = 0.9
    local_epochs: int = 1
    num_attackers: int = 4
    attack_scale: float = -10.0
    inflate_factor: int = 100

    def scenario(self) -> Scenario:
        return Scenario(
            name="strategies", seed=self.seed, num_clients=self.num_clients,
            clients_per_round=self.num_clients, local_epochs=self.local_epochs,
            progress=False,
            partition=PartitionSpec(name=self.partition, alpha=self.alpha,
                                    min_size=self.min_size),
            model=ModelSpec(hidden=self.hidden),
            client=ClientSpec(batch_size=self.batch_size, lr=self.lr, momentum=self.momentum),
        )

    @property
    def attackers(self) -> range:
        return range(self.num_clients - self.num_attackers, self.num_clients)


class Federation:
    """A `Setup` made concrete: the job's data, client factories and central evaluation."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.job = Job.from_scenario(setup.scenario())

    def initial_weights(self) -> Weights:
        if self.setup.model == "softmax":
            return SoftmaxRegressionClient.initial_weights(
                self.job.num_features, self.job.num_classes, self.setup.seed)
        return self.job.initial_weights()

    def evaluate(self, weights: Weights) -> dict[str, Scalar]:
        if self.setup.model == "softmax":
            loss, accuracy = softmax_evaluate(weights, self.job.x_test, self.job.y_test)
            return {"test_loss": loss, "test_accuracy": accuracy}
        if not all(np.isfinite(a).all() for a in weights.values() if a.dtype.kind == "f"):
            return {"test_loss": float("inf"), "test_accuracy": 0.0}
        return self.job.central_evaluate(weights)

    def _honest(self, data: ClientData, model: object) -> Client:
        s = self.setup
        if s.model == "softmax":
            return SoftmaxRegressionClient(data.x, data.y, self.job.num_classes, lr=s.lr,
                                           batch_size=s.batch_size,
                                           local_epochs=s.local_epochs)
        from fedloom.simulations.models import make_torch_client

        return make_torch_client(
            data.x, data.y, batch_size=s.batch_size, local_epochs=s.local_epochs, lr=s.lr,
            momentum=s.momentum, seed=s.seed, model=model,  # type: ignore[arg-type]
            hidden=s.hidden, num_classes=self.job.num_classes,
        )

    def client_factory(self, attack: Attack) -> Callable[[int], Client]:
        """Client ``i`` of this federation under ``attack`` (cached: fits run one by one)."""
        s = self.setup
        shared = self.job.make_model() if s.model == "mlp" else None
        cache: dict[int, Client] = {}

        def make(index: int) -> Client:
            if index in cache:
                return cache[index]
            data = self.job.clients[index]
            evil = attack != "none" and index in s.attackers
            if evil and attack == "inflate":
                client: Client = InflateClient(
                    self._honest(shift_labels(data, self.job.num_classes), shared),
                    s.inflate_factor)
            elif evil and attack == "sign_flip":
                client = SignFlipClient(self._honest(data, shared), s.attack_scale)
            elif evil and attack == "noise":
                client = NoiseClient(self._honest(data, shared), abs(s.attack_scale))
            else:
                client = self._honest(data, shared)
            cache[index] = client
            return client

        return make


def run_experiment(
    strategy: Strategy, federation: Federation, attack: Attack, rounds: int,
    *, stop_at: float | None = None,
) -> History:
    """Run ``strategy`` for ``rounds`` rounds on ``federation`` under ``attack``.

    With ``stop_at`` the run ends after the first round whose central test accuracy
    reaches it (the convergence experiment needs only that round).
    """
    records: list[RoundRecord] = []

    def evaluate(server_round: int, weights: Weights) -> dict[str, Scalar]:
        return federation.evaluate(weights)

    def on_round(record: RoundRecord) -> None:
        records.append(record)
        accuracy = record.get("test_accuracy")
        if stop_at is not None and isinstance(accuracy, float) and accuracy >= stop_at:
            raise _TargetReached

    threads = _one_torch_thread() if federation.setup.model == "mlp" else contextlib.nullcontext()
    with threads:
        try:
            return run_local(
                strategy, federation.client_factory(attack), federation.initial_weights(),
                num_clients=federation.setup.num_clients, num_rounds=rounds,
                base_seed=federation.setup.seed,
                fit_defaults={"local_epochs": federation.setup.local_epochs},
                evaluate_fn=evaluate, on_round=on_round,
            )
        except _TargetReached:
            return History("local", records)


class _TargetReached(Exception):
    """Ends a run early once the target accuracy is reached."""


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """One torch thread while the fits run (as the local engine's scenarios do)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def rounds_to_reach(history: History, target: float) -> int | None:
    """The first round whose central test accuracy is at least ``target`` (None: never)."""
    for server_round, accuracy in history.series("test_accuracy"):
        if accuracy >= target:
            return server_round
    return None


def final_accuracy(history: History, last: int = 3) -> float:
    """Mean central test accuracy over the last ``last`` rounds (smooths round noise)."""
    points = [a for r, a in history.series("test_accuracy") if r > 0][-last:]
    return float(np.mean(points)) if points else float("nan")
