"""Aggregation strategies: pure numpy math on kernel types.

Never imports the server, grpc, protobuf, torch or flwr. See `strategies._base` for the
contract and `build_strategy` for building one by name from configuration.
"""

from fedloom.strategies._base import Aggregator, MeanUpdate, ServerOptimizer, StateDict, Strategy
from fedloom.strategies._composed import ComposedStrategy
from fedloom.strategies._fedavg import FedAvg
from fedloom.strategies._mean import WeightedMeanAggregator
from fedloom.strategies._optimizers import ServerSGD, add_delta
from fedloom.strategies._registry import STRATEGIES, build_strategy
from fedloom.strategies._sampling import ClientSampler

__all__ = [
    "STRATEGIES",
    "Aggregator",
    "ClientSampler",
    "ComposedStrategy",
    "FedAvg",
    "MeanUpdate",
    "ServerOptimizer",
    "ServerSGD",
    "StateDict",
    "Strategy",
    "WeightedMeanAggregator",
    "add_delta",
    "build_strategy",
]
