"""`Job`: a `Scenario` made concrete — client data, model, strategy, central evaluation.

Both engines run the same `Job`: the local engine in this process, Flower's engine in
Ray actors (the job is pickled to them). Everything here is a pure function of the
scenario, so two processes building the same scenario get the same job.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from fedloom.client_sdk.torch_trainer import TorchClient, evaluate_module, load_weights
from fedloom.errors import ConfigError
from fedloom.fit_config import LOCAL_EPOCHS
from fedloom.simulations import datasets, partition
from fedloom.simulations.models import initial_weights, make_mlp, make_torch_client
from fedloom.simulations.scenario import Scenario
from fedloom.strategies import Strategy, apply_privacy, build_strategy
from fedloom.types import Scalar
from fedloom.weights import Weights


@dataclasses.dataclass(frozen=True)
class ClientData:
    """One client's arrays; ``x_val``/``y_val`` are None when it has no local test split."""

    x: np.ndarray
    y: np.ndarray
    x_val: np.ndarray | None = None
    y_val: np.ndarray | None = None


@dataclasses.dataclass
class Job:
    """Data and factories for one scenario; build with `Job.from_scenario`."""

    scenario: Scenario
    clients: list[ClientData]
    x_test: np.ndarray
    y_test: np.ndarray
    num_features: int
    num_classes: int
    _eval_model: torch.nn.Module | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def from_scenario(cls, scenario: Scenario) -> Job:
        ds, part = scenario.dataset, scenario.partition
        if ds.name == "synthetic":
            splits = datasets.synthetic(
                ds.alpha, ds.beta, scenario.num_clients, seed=scenario.seed,
                test_fraction=ds.test_fraction, max_samples=ds.max_samples, iid=ds.iid,
            )
            clients = [ClientData(s.x_train, s.y_train, s.x_test, s.y_test) for s in splits]
            x_test = np.concatenate([s.x_test for s in splits])
            y_test = np.concatenate([s.y_test for s in splits])
            num_classes = 10
        else:
            split = datasets.load_digits(ds.test_fraction, scenario.seed)
            n, k, seed = len(split.y_train), scenario.num_clients, scenario.seed
            name = scenario.partition_name
            with _scenario_names():
                if name == "iid":
                    parts = partition.iid_partition(n, k, seed)
                elif name == "dirichlet":
                    parts = partition.dirichlet_partition(
                        split.y_train, k, part.alpha, seed, part.min_size, part.max_retries
                    )
                else:
                    parts = partition.shard_partition(split.y_train, k,
                                                      part.shards_per_client, seed)
            clients = [ClientData(split.x_train[p], split.y_train[p]) for p in parts]
            x_test, y_test, num_classes = split.x_test, split.y_test, split.num_classes
        return cls(scenario, clients, x_test, y_test, int(x_test.shape[1]), num_classes)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_eval_model"] = None  # rebuilt where needed; keeps pickles small
        return state

    # -- factories -------------------------------------------------------------------
    def make_model(self) -> torch.nn.Module:
        return make_mlp(self.num_features, self.scenario.model.hidden, self.num_classes)

    def initial_weights(self) -> Weights:
        """The global model of round 0, from the scenario's seed."""
        return initial_weights(self.make_model(), self.scenario.seed)

    def make_client(self, index: int, model: torch.nn.Module | None = None) -> TorchClient:
        """Client ``index``'s `TorchClient` (``model`` may be shared: fits run one by one)."""
        data, spec = self.clients[index], self.scenario.client
        return make_torch_client(
            data.x, data.y, x_val=data.x_val, y_val=data.y_val,
            batch_size=spec.batch_size, local_epochs=self.scenario.local_epochs,
            lr=spec.lr, momentum=spec.momentum, seed=self.scenario.seed,
            model=model if model is not None else self.make_model(),
            device=spec.device, optimizer=spec.optimizer,
        )

    def client_fn(self, model: torch.nn.Module | None = None) -> Callable[[int], TorchClient]:
        """Client ``index``'s `make_client`, built at its first call and kept: every
        client of one process trains one module (``model``, or a new one), as the
        engines that fit clients one after another use them."""
        shared = model if model is not None else self.make_model()
        clients: dict[int, TorchClient] = {}

        def client(index: int) -> TorchClient:
            if index not in clients:
                clients[index] = self.make_client(index, model=shared)
            return clients[index]

        return client

    def build_strategy(self) -> Strategy:
        strategy = build_strategy(self.scenario.strategy, self.scenario.selection)
        secure = self.scenario.secure_aggregation
        return apply_privacy(strategy, self.scenario.privacy,
                             colluding_clients=secure.colluding_clients)

    def fit_defaults(self) -> dict[str, Scalar]:
        """Run-wide client settings every fit config carries (a strategy's own win).

        ``client.lr`` is the clients' own default, not sent: a strategy that sets the
        client learning rate (FedOpt's ``eta_l``) then reaches `TorchClient`, which
        reads ``lr`` before ``eta_l``.
        """
        return {LOCAL_EPOCHS: self.scenario.local_epochs}

    def central_evaluate(self, weights: Weights) -> dict[str, Scalar]:
        """Loss and accuracy of ``weights`` on the held-out test set (CPU)."""
        if self._eval_model is None:
            self._eval_model = self.make_model()
        load_weights(self._eval_model, weights)
        x, y = torch.from_numpy(self.x_test), torch.from_numpy(self.y_test)
        loss, accuracy, _ = evaluate_module(
            self._eval_model, [(x, y)], torch.nn.CrossEntropyLoss(), torch.device("cpu")
        )
        if accuracy is None:  # the model does not classify
            return {"test_loss": loss}
        return {"test_loss": loss, "test_accuracy": accuracy}


#: The partitioners' settings, which a scenario holds in its [partition] table.
_PARTITION_SETTINGS = ("alpha", "min_size", "max_retries", "shards_per_client")


@contextlib.contextmanager
def _scenario_names() -> Iterator[None]:
    """Name a partitioner's refused setting as the scenario does (``partition.min_size``,
    not ``min_size``), so the error points at the key to change."""
    try:
        yield
    except ConfigError as exc:
        if exc.setting not in _PARTITION_SETTINGS:
            raise
        raise ConfigError(f"partition.{exc.setting}", exc.problem) from exc
