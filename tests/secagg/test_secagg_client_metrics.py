"""A secure run keeps only aggregates: no per-client rows in the run store (even with
``[metrics] per_client`` on), and the strategy's fit metrics hook is never called (the
server holds no client's fit metrics, only sums)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from e2e_harness import RecordingClient, run_to_end, secagg
from helpers import small_weights

from fedloom.server import Server
from fedloom.server.run_report import print_runs
from fedloom.server.store import RunStore
from fedloom.strategies import FedAvg


def test_a_secure_run_records_no_client_rows_and_never_calls_the_fit_hook(
        server_config, mtls, pki) -> None:  # type: ignore[no-untyped-def]
    config = server_config(**mtls, num_rounds=2, min_clients=6, min_fit_clients=6,
                           secure_aggregation=secagg())
    assert config.metrics.per_client  # the default: the secure run overrides it
    fit_calls: list[Any] = []
    evaluate_calls: list[Any] = []

    def fit_hook(results: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
        fit_calls.append(results)
        return {"seen": len(results)}

    def evaluate_hook(results: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
        evaluate_calls.append(results)  # evaluation is not masked: its hook runs
        return {"evaluated": len(results)}

    strategy = FedAvg(selection=config.selection, fit_metrics_aggregation_fn=fit_hook,
                      evaluate_metrics_aggregation_fn=evaluate_hook)
    server = Server(config, initial_weights=small_weights(), strategy=strategy)
    handle = server.start()
    clients = [RecordingClient(seed=i, num_examples=10 * (i + 1)) for i in range(6)]
    history, _ = run_to_end(handle, clients, pki)
    assert [r.status for r in history] == ["ok", "ok"]
    assert fit_calls == [] and [len(c) for c in evaluate_calls] == [6, 6]
    assert history[0].fit == {"num_updates": 6, "num_examples": 210}  # sums only
    assert history[0].evaluate["evaluated"] == 6

    assert server.coordinator is not None
    run_id = server.coordinator.run_id
    store = RunStore(Path(config.state_dir) / "fedloom.db", readonly=True)
    try:
        assert store.client_rows(run_id) == {}
    finally:
        store.close()
    out = io.StringIO()
    print_runs(config.state_dir, run_id, clients=True, out=out)
    assert "no per-client metrics (secure aggregation keeps only aggregates)" in out.getvalue()
