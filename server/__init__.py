"""The fedloom aggregation server (gRPC, ``grpc.aio``).

`Server` is the entry point; `save_weights` / `load_weights` read and write the
safetensors files a server starts from. The secure-aggregation protocol it runs is in
`fedloom.secagg` (the state machines any engine can drive) and its transport in
`fedloom.server.secure`.
"""

from fedloom.server.app import Server, ServerHandle
from fedloom.server.checkpoint import load_weights, save_weights
from fedloom.server.coordinator import EvaluateFn

__all__ = [
    "EvaluateFn",
    "Server",
    "ServerHandle",
    "load_weights",
    "save_weights",
]
