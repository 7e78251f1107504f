"""Runnable examples of both bridges: fedloom inside Flower apps, in each direction.

- `fedloom_server_app`: a Flower ``ServerApp`` whose strategy is a fedloom strategy
  (`FlowerStrategy`), here FedAvg with seeded sampling; it drives *any* ClientApp,
  e.g. `flower_client_app`, written the way Flower's quickstart writes one;
- `fedloom_client_app`: a Flower ``ClientApp`` around a fedloom `TorchClient`
  (`to_client_app`); it serves *any* message-API strategy, e.g. `flower_server_app`,
  which runs Flower's own FedAvg.

Every node trains on its IID share of scikit-learn's digits (``partition-id`` of
``num-partitions`` from its node config). Run a pairing on Flower's simulation engine::

    from flwr.simulation import run_simulation
    from fedloom.simulations import flower_examples as ex

    run_simulation(ex.fedloom_server_app, ex.flower_client_app, num_supernodes=10)
    run_simulation(ex.flower_server_app, ex.fedloom_client_app, num_supernodes=10)

or deploy them with ``flwr run`` by naming them in an app's ``pyproject.toml``
(``serverapp = "fedloom.simulations.flower_examples:fedloom_server_app"``). Run-config
keys: ``num-rounds`` (default 3), ``fraction-train`` (0.5), ``seed`` (0), and for
`fedloom_server_app` ``identify-nodes`` (false: its ClientApps are plain Flower ones,
which are not sent the bridge's identity query; true over fedloom ClientApps).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from fedloom.client_sdk.torch_trainer import TorchClient
from fedloom.fit_config import LEARNING_RATE, LOCAL_EPOCHS
from fedloom.simulations import datasets, partition
from fedloom.simulations._records import weights_to_arrays
from fedloom.simulations.flower_client import partition_id, to_client_app
from fedloom.simulations.flower_strategy import FlowerStrategy
from fedloom.simulations.models import initial_weights, make_mlp, make_torch_client
from fedloom.strategies import FedAvg, SelectionConfig


@functools.lru_cache(maxsize=4)
def _shard(index: int, num_partitions: int) -> tuple[np.ndarray, np.ndarray]:
    data = datasets.load_digits()
    part = partition.iid_partition(len(data.y_train), num_partitions, seed=0)[index]
    return data.x_train[part], data.y_train[part]


def _num_partitions(context: Context) -> int:
    return int(context.node_config.get("num-partitions", 10))


def _run_setting(context: Context, key: str, default: float) -> float:
    value = context.run_config.get(key, default)
    return float(value) if isinstance(value, int | float) else default


def _initial_arrays(seed: int) -> ArrayRecord:
    return weights_to_arrays(initial_weights(make_mlp(), seed))


# -- a fedloom strategy in a Flower ServerApp -------------------------------------------
fedloom_server_app = ServerApp()


@fedloom_server_app.main()
def fedloom_server_main(grid: Grid, context: Context) -> None:
    seed = int(_run_setting(context, "seed", 0))
    fraction = _run_setting(context, "fraction-train", 0.5)
    strategy = FlowerStrategy(
        FedAvg(selection=SelectionConfig(fraction_fit=fraction, min_fit_clients=1,
                                         fraction_evaluate=0.0, seed=seed)),
        base_seed=seed,
        identify_nodes=bool(context.run_config.get("identify-nodes", False)),
    )
    strategy.start(grid, _initial_arrays(seed), num_rounds=int(_run_setting(context,
                   "num-rounds", 3)), train_config=ConfigRecord({LOCAL_EPOCHS: 1}))


# -- a Flower-style ClientApp (what a Flower user already has) --------------------------
flower_client_app = ClientApp()


@flower_client_app.train()
def flower_client_train(message: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    x, y = _shard(int(context.node_config["partition-id"]), _num_partitions(context))
    model = make_mlp()
    arrays = message.content["arrays"]
    assert isinstance(arrays, ArrayRecord)
    model.load_state_dict(arrays.to_torch_state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    inputs, targets = torch.from_numpy(x.copy()), torch.from_numpy(y.copy())
    for start in range(0, len(targets), 32):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs[start:start + 32]),
                                                 targets[start:start + 32])
        loss.backward()
        optimizer.step()
    content = RecordDict({
        "arrays": ArrayRecord(model.state_dict()),
        "metrics": MetricRecord({"train_loss": loss.item(), "num-examples": len(targets)}),
    })
    return Message(content, reply_to=message)


# -- a fedloom client in a Flower ClientApp ---------------------------------------------
def _fedloom_client(context: Context) -> TorchClient:
    torch.set_num_threads(1)
    x, y = _shard(partition_id(context), _num_partitions(context))
    return make_torch_client(x, y, seed=0)


fedloom_client_app = to_client_app(_fedloom_client)


# -- Flower's own FedAvg in a ServerApp --------------------------------------------------
flower_server_app = ServerApp()


@flower_server_app.main()
def flower_server_main(grid: Grid, context: Context) -> None:
    FlowerFedAvg(fraction_train=_run_setting(context, "fraction-train", 0.5),
                 fraction_evaluate=0.0, min_train_nodes=1, min_available_nodes=1).start(
        grid, _initial_arrays(int(_run_setting(context, "seed", 0))),
        num_rounds=int(_run_setting(context, "num-rounds", 3)),
        train_config=ConfigRecord({LEARNING_RATE: 0.05}),
    )
