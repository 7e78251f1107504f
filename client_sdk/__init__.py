"""The fedloom client SDK: implement `Client` (or use `TorchClient`) and call
`start_client`; wrap each task in `Middleware` of your own (docs/client.md).

The base install needs no torch; `TorchClient` is imported lazily from
``fedloom.client_sdk.torch_trainer`` (``pip install fedloom[torch]``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedloom.client_sdk._client import Client, EvaluateOutput, FitOutput
from fedloom.client_sdk._middleware import (
    CallNext,
    Middleware,
    PushListener,
    TaskContext,
    TaskResult,
)
from fedloom.client_sdk.runner import Backoff, ClientRunner, ClientStats, start_client
from fedloom.errors import AccessDeniedError

if TYPE_CHECKING:
    from fedloom.client_sdk.torch_trainer import TorchClient

__all__ = [
    "AccessDeniedError",
    "Backoff",
    "CallNext",
    "Client",
    "ClientRunner",
    "ClientStats",
    "EvaluateOutput",
    "FitOutput",
    "Middleware",
    "PushListener",
    "TaskContext",
    "TaskResult",
    "TorchClient",
    "start_client",
]


def __getattr__(name: str) -> Any:
    if name == "TorchClient":
        from fedloom.client_sdk.torch_trainer import TorchClient

        return TorchClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
