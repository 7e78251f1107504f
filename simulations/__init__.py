"""Simulation: many virtual clients running fedloom strategies and clients, no server.

- data: `load_digits`, `synthetic` (FedProx's Synthetic(alpha, beta)); partitioners
  `iid_partition`, `dirichlet_partition`, `shard_partition`;
- models (torch): `make_mlp`, `make_torch_client`;
- runs: a `Scenario` (TOML: `load_scenario`) run by `run_scenario` on the local engine
  (`run_local`: one process) or Flower's (`run_flower`: Ray), giving a `History`;
- time: client speeds (`SpeedModel`) on a virtual clock (`SyncClock` for synchronous
  rounds), and buffered asynchronous aggregation, FedBuff (`run_local_async`);
- bridges (flwr): `FlowerStrategy` puts a fedloom strategy in a Flower ``ServerApp``;
  `to_client_app` puts a fedloom client in a Flower ``ClientApp``;
- determinism: `fit_seed`, `client_info`, `client_fit_config` are the rules every engine
  follows (seed per client and round, sampling over partition ids).

torch and flwr are imported only when a name that needs them is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fedloom.simulations.clock import SyncClock
from fedloom.simulations.datasets import DataSplit, load_digits, synthetic
from fedloom.simulations.history import History, RoundRecord
from fedloom.simulations.local_async import run_local_async
from fedloom.simulations.local_engine import run_local
from fedloom.simulations.partition import dirichlet_partition, iid_partition, shard_partition
from fedloom.simulations.plan import client_fit_config, client_info, fit_seed
from fedloom.simulations.scenario import Scenario, load_scenario
from fedloom.simulations.speed import SpeedModel

if TYPE_CHECKING:
    from fedloom.simulations.flower_client import to_client_app
    from fedloom.simulations.flower_engine import run_flower
    from fedloom.simulations.flower_strategy import FlowerStrategy
    from fedloom.simulations.models import make_mlp, make_torch_client
    from fedloom.simulations.runner import run_scenario

_LAZY = {
    "FlowerStrategy": "fedloom.simulations.flower_strategy",
    "to_client_app": "fedloom.simulations.flower_client",
    "run_flower": "fedloom.simulations.flower_engine",
    "make_mlp": "fedloom.simulations.models",
    "make_torch_client": "fedloom.simulations.models",
    "run_scenario": "fedloom.simulations.runner",
}

__all__ = [
    "DataSplit",
    "FlowerStrategy",
    "History",
    "RoundRecord",
    "Scenario",
    "SpeedModel",
    "SyncClock",
    "client_fit_config",
    "client_info",
    "dirichlet_partition",
    "fit_seed",
    "iid_partition",
    "load_digits",
    "load_scenario",
    "make_mlp",
    "make_torch_client",
    "run_flower",
    "run_local",
    "run_local_async",
    "run_scenario",
    "shard_partition",
    "synthetic",
    "to_client_app",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
