"""The public names of the kernel, the server and the client SDK are pinned.

A name added or removed here is an API change: update the list on purpose. (The
strategies, simulation and secure-aggregation packages pin theirs in their own suites.)
"""

from __future__ import annotations

import importlib

import pytest

PINNED = {
    "fedloom": [
        "SUPPORTED_DTYPES", "AggregateResult", "AggregationError", "AuthConfig",
        "CheckpointError", "ClientConfig", "ClientInfo", "ClientUpdate", "Config",
        "ConfigError", "EvaluatePlan", "EvaluateResult", "FedloomError", "FitPlan",
        "MessageRejectedError", "Metrics", "RejectReason", "RoundAbortedError", "RoundRecord",
        "Scalar", "SecAggConfig", "SecureAggregationError", "SelectionConfig", "ServerConfig",
        "StrategyConfig",
        "TLSConfig", "TaskKind", "TensorSpec", "TransferConfig", "TransportError",
        "Weights", "__version__",
    ],
    "fedloom.server": [
        "EvaluateFn", "Server", "ServerHandle", "load_weights", "save_weights",
    ],
    "fedloom.client_sdk": [
        "AccessDeniedError", "Backoff", "CallNext", "Client", "ClientRunner", "ClientStats",
        "EvaluateOutput", "FitOutput", "Middleware", "PushListener", "TaskContext",
        "TaskResult", "TorchClient", "start_client",
    ],
}


@pytest.mark.parametrize("module", list(PINNED))
def test_exported_names_are_pinned_and_importable(module: str) -> None:
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(PINNED[module])
    for name in mod.__all__:
        assert getattr(mod, name) is not None, name
