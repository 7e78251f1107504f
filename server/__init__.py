"""The fedloom aggregation server (gRPC, ``grpc.aio``).

`Server` is the entry point; `save_weights` / `load_weights` read and write the
safetensors files a server starts from. `SecAggServer` (the pure SecAgg+ state machine)
and `aggregate_secure_mean` / `check_secure_strategy` (how a secure round's mean meets
the strategy) are public so that other engines (the local simulation engine) run secure
rounds exactly as the server does.
"""

from fedloom.server.app import Server, ServerHandle
from fedloom.server.checkpoint import load_weights, save_weights
from fedloom.server.coordinator import EvaluateFn
from fedloom.server.secagg import SecAggResult, SecAggServer, SecAggStatus
from fedloom.server.secure_mean import aggregate_secure_mean, check_secure_strategy

__all__ = [
    "EvaluateFn",
    "SecAggResult",
    "SecAggServer",
    "SecAggStatus",
    "Server",
    "ServerHandle",
    "aggregate_secure_mean",
    "check_secure_strategy",
    "load_weights",
    "save_weights",
]
