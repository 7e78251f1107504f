"""Per-client metrics: what each client reported in a round, kept beside the round.

With ``[metrics] per_client`` (the default) the round drivers note each accepted fit
result (the client, its ``num_examples``, the metrics it sent) and federated
evaluation notes each evaluate result (also its loss); the round loop commits them in
the round's own transaction (`fedloom.server.store.RunStore.commit_round`), so a
round's rows are all there or none are. ``fedloom runs RUN --clients`` shows them.

A run under secure aggregation or differential privacy records none: under SecAgg+
the server never sees a client's fit metrics (a secure round's fit result is a masked
sum; no client's metrics travel with it), and under ``[privacy]`` the clients' metrics
are functions of their data that the guarantee does not cover. The evaluate results
such a server does see are not kept per client either: a secure or private run keeps
only aggregates.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fedloom.config import ServerConfig
from fedloom.server.registry import ClientRegistry
from fedloom.server.store import ClientRow
from fedloom.strategies import CentralDPStrategy
from fedloom.types import EvaluateResult, Metrics

FIT = "fit"
EVALUATE = "evaluate"


def why_not_per_client(config: ServerConfig, strategy: Any) -> str:
    """Why this server records no per-client metrics ("" when it does)."""
    if not config.metrics.per_client:
        return "metrics.per_client = false"
    if config.secure_aggregation.enabled:
        return "secure aggregation is on (the server sees no client's fit metrics)"
    if config.privacy.enabled or isinstance(strategy, CentralDPStrategy):
        return "differential privacy is on (client metrics are outside its guarantee)"
    return ""


def records_per_client(config: ServerConfig, strategy: Any) -> bool:
    """Whether the rounds of this server keep each client's metrics."""
    return not why_not_per_client(config, strategy)


def _name(registry: ClientRegistry, client_id: str) -> str:
    record = registry.get(client_id)
    return record.info.name if record is not None else ""


def fit_row(registry: ClientRegistry, client_id: str, num_examples: int,
            metrics: Metrics) -> ClientRow:
    """One accepted fit result, as the client sent it."""
    return ClientRow(FIT, client_id, _name(registry, client_id), num_examples, dict(metrics))


def evaluate_rows(registry: ClientRegistry, results: Iterable[EvaluateResult]
                  ) -> list[ClientRow]:
    """The accepted evaluate results of a round, in the order they came."""
    return [ClientRow(EVALUATE, r.client_id, _name(registry, r.client_id), r.num_examples,
                      dict(r.metrics), r.loss) for r in results]
