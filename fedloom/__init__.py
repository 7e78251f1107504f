"""fedloom: federated learning with a gRPC aggregation server, a client SDK, composable
strategies and secure aggregation.

This package is the shared kernel: `Weights`, the round and task types, the error tree
and the configuration types. It imports nothing of the rest of the project, and no
grpc, protobuf, torch or flwr. The wings live in ``fedloom.server``,
``fedloom.client_sdk``, ``fedloom.strategies``, ``fedloom.protos`` and
``fedloom.simulations``.
"""

from fedloom.config import (
    AuthConfig,
    ClientConfig,
    SelectionConfig,
    ServerConfig,
    StrategyConfig,
    TLSConfig,
    TransferConfig,
)
from fedloom.errors import (
    AggregationError,
    CheckpointError,
    ConfigError,
    FedloomError,
    MessageRejectedError,
    RejectReason,
    RoundAbortedError,
    SecureAggregationError,
    TransportError,
)
from fedloom.records import RoundRecord
from fedloom.secagg import SecAggConfig
from fedloom.types import (
    AggregateResult,
    ClientInfo,
    ClientUpdate,
    Config,
    EvaluatePlan,
    EvaluateResult,
    FitPlan,
    Metrics,
    Scalar,
    TaskKind,
)
from fedloom.weights import SUPPORTED_DTYPES, TensorSpec, Weights

__version__ = "0.1.0"

__all__ = [
    "SUPPORTED_DTYPES",
    "AggregateResult",
    "AggregationError",
    "AuthConfig",
    "CheckpointError",
    "ClientConfig",
    "ClientInfo",
    "ClientUpdate",
    "Config",
    "ConfigError",
    "EvaluatePlan",
    "EvaluateResult",
    "FedloomError",
    "FitPlan",
    "MessageRejectedError",
    "Metrics",
    "RejectReason",
    "RoundAbortedError",
    "RoundRecord",
    "Scalar",
    "SecAggConfig",
    "SecureAggregationError",
    "SelectionConfig",
    "ServerConfig",
    "StrategyConfig",
    "TLSConfig",
    "TaskKind",
    "TensorSpec",
    "TransferConfig",
    "TransportError",
    "Weights",
    "__version__",
]
