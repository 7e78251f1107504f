"""Per-client metrics: each client's fit and evaluate results, committed with the round
(``[metrics] per_client``), shown by ``fedloom runs RUN --clients``; and the strategies'
metrics hooks as a real server records them."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from helpers import ScriptedClient, run_clients, small_weights

from fedloom.cli import main
from fedloom.client_sdk import EvaluateOutput, FitOutput
from fedloom.config import MetricsConfig
from fedloom.privacy import PrivacyConfig
from fedloom.server import Server
from fedloom.server.store import ClientRow, RoundRow, RunStore
from fedloom.strategies import CentralDPStrategy, FedAvg

NUM_CLIENTS = 3


class ReportingClient(ScriptedClient):
    """Sends metrics of its own (a number, a string and bytes) that name the client."""

    def __init__(self, index: int) -> None:
        super().__init__(seed=index, num_examples=10 * (index + 1))
        self.index = index

    def fit(self, weights, config):  # type: ignore[no-untyped-def]
        out = super().fit(weights, config)
        metrics = {"train_loss": 0.25 * (self.index + 1), "site": f"site-{self.index}",
                   "blob": bytes([self.index, 255])}
        return FitOutput(out.weights, out.num_examples, metrics)

    def evaluate(self, weights, config):  # type: ignore[no-untyped-def]
        return EvaluateOutput(float(self.index + 1), self.num_examples,
                              {"accuracy": 0.1 * (self.index + 1)})


def _run(server_config, strategy=None, **overrides) -> tuple[Server, str]:  # type: ignore[no-untyped-def]
    config = server_config(num_rounds=2, **overrides)
    if strategy is not None:
        strategy = strategy(config)
    server = Server(config, initial_weights=small_weights(), strategy=strategy)
    handle = server.start()
    threads = run_clients(handle.address, [ReportingClient(i) for i in range(NUM_CLIENTS)])
    history = handle.wait(60)
    for t in threads:
        t.join(10)
    assert [r.status for r in history] == ["ok", "ok"]
    assert server.coordinator is not None
    return server, server.coordinator.run_id


def _client_rows(state_dir: str, run_id: str) -> dict[int, list[ClientRow]]:
    store = RunStore(Path(state_dir) / "fedloom.db", readonly=True)
    try:
        return store.client_rows(run_id)
    finally:
        store.close()


def test_each_clients_fit_and_evaluate_results_are_committed_with_the_round(
        server_config) -> None:  # type: ignore[no-untyped-def]
    server, run_id = _run(server_config)
    rows = _client_rows(server.config.state_dir, run_id)
    assert sorted(rows) == [1, 2]  # round 0 (the initial model) has no clients
    for server_round in (1, 2):
        fit = [r for r in rows[server_round] if r.phase == "fit"]
        evaluate = [r for r in rows[server_round] if r.phase == "evaluate"]
        assert [r.phase for r in rows[server_round]] == ["fit"] * 3 + ["evaluate"] * 3
        by_name = {r.client_name: r for r in fit}
        assert sorted(by_name) == ["c0", "c1", "c2"]  # run_clients names them c0, c1, c2
        for i in range(NUM_CLIENTS):
            row = by_name[f"c{i}"]
            assert row.num_examples == 10 * (i + 1) and row.loss is None
            # exactly what the client sent, bytes included
            assert row.metrics == {"train_loss": 0.25 * (i + 1), "site": f"site-{i}",
                                   "blob": bytes([i, 255])}
        ids = {r.client_id for r in fit}
        assert len(ids) == 3 and {r.client_id for r in evaluate} == ids
        for row in evaluate:
            i = int(row.client_name[1:])
            assert row.loss == float(i + 1) and row.metrics == {"accuracy": 0.1 * (i + 1)}
        # the round's federated loss is the examples-weighted mean of the rows' losses
        record = server.coordinator.history[server_round - 1]  # type: ignore[union-attr]
        weighted = sum(r.num_examples * (r.loss or 0.0) for r in evaluate)
        assert record.evaluate["loss"] == pytest.approx(
            weighted / sum(r.num_examples for r in evaluate))


def test_runs_clients_prints_them_as_a_table_and_as_json(server_config, capsys) -> None:  # type: ignore[no-untyped-def]
    server, run_id = _run(server_config)
    state_dir = server.config.state_dir
    assert main(["runs", run_id, "--clients", "--state-dir", state_dir]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"run {run_id} (finished): per-client metrics"
    assert lines[1].split() == ["ROUND", "PHASE", "CLIENT", "EXAMPLES", "LOSS", "METRICS"]
    table = sorted(line.split() for line in lines[2:])
    assert len(table) == 12  # 2 rounds x 3 clients x (fit, evaluate)
    # metrics by name: the wire does not keep the order a client gave them in
    assert ["1", "fit", "c1", "20", "-", "blob=01ff", "site=site-1", "train_loss=0.5"] in table
    assert ["2", "evaluate", "c2", "30", "3.0000", "accuracy=0.3"] in table

    assert main(["runs", run_id[:10], "--clients", "--json", "--state-dir", state_dir]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert run["rounds"][0]["clients"] == []  # round 0
    for entry in run["rounds"][1:]:
        assert [c["phase"] for c in entry["clients"]] == ["fit"] * 3 + ["evaluate"] * 3
        c0 = next(c for c in entry["clients"] if c["client_name"] == "c0")
        assert c0["num_examples"] == 10 and c0["loss"] is None
        assert c0["metrics"] == {"train_loss": 0.25, "site": "site-0", "blob": "00ff"}

    # without --clients the JSON document is the per-round one it always was
    assert main(["runs", run_id, "--json", "--state-dir", state_dir]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert all("clients" not in entry for entry in run["rounds"])
    # --clients names one run
    assert main(["runs", "--clients", "--state-dir", state_dir]) == 2
    assert "fedloom runs RUN_ID --clients" in capsys.readouterr().err


def test_per_client_false_stores_none_and_says_so(server_config, capsys) -> None:  # type: ignore[no-untyped-def]
    server, run_id = _run(server_config, metrics=MetricsConfig(per_client=False))
    state_dir = server.config.state_dir
    assert _client_rows(state_dir, run_id) == {}
    db = sqlite3.connect(Path(state_dir) / "fedloom.db")
    try:
        assert db.execute("SELECT COUNT(*) FROM client_metrics").fetchone() == (0,)
    finally:
        db.close()
    assert main(["runs", run_id, "--clients", "--state-dir", state_dir]) == 0
    assert "no per-client metrics (metrics.per_client = false)" in capsys.readouterr().out
    assert main(["runs", run_id, "--clients", "--json", "--state-dir", state_dir]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert [entry["clients"] for entry in run["rounds"]] == [[], [], []]
    assert run["config"]["metrics"] == {"per_client": False}
    # the aggregates are still there
    assert run["rounds"][2]["metrics"]["fit"]["num_updates"] == 3


def _row(server_round: int) -> RoundRow:
    return RoundRow("run", server_round, "ok", "f", "0" * 64, {}, 0.0, 0.0)


def test_a_round_and_its_client_rows_commit_together_or_not_at_all(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "fedloom.db")
    try:
        store.create_run("run", 3, {})
        clients = [ClientRow("fit", "a", "site-a", 5, {"x": 1.0, "b": b"\x00"}),
                   ClientRow("evaluate", "a", "site-a", 5, {}, loss=0.5)]
        store.commit_round(_row(1), clients)
        # the round's insert fails after its client rows went in: none of them stay
        with pytest.raises(sqlite3.IntegrityError):
            store.commit_round(_row(1), [ClientRow("fit", "z", "", 1, {"late": 1})])
        rows = store.client_rows("run")
        assert [(r.phase, r.client_id, r.metrics, r.loss) for r in rows[1]] == [
            ("fit", "a", {"x": 1.0, "b": b"\x00"}, None), ("evaluate", "a", {}, 0.5)]
        store.commit_round(_row(2), clients)
        # a resumed run drops the rounds after its checkpoint, and their clients with them
        store.forget_rounds_after("run", 1)
        assert sorted(store.client_rows("run")) == [1]
        store.commit_round(_row(2), clients[:1])  # the round runs again
        assert [r.client_id for r in store.client_rows("run")[2]] == ["a"]
    finally:
        store.close()


def test_runs_reads_a_database_from_before_client_metrics(server_config, capsys) -> None:  # type: ignore[no-untyped-def]
    server, run_id = _run(server_config)
    db = sqlite3.connect(Path(server.config.state_dir) / "fedloom.db")
    db.execute("DROP TABLE client_metrics")
    db.commit()
    db.close()
    assert main(["runs", run_id, "--clients", "--state-dir", server.config.state_dir]) == 0
    assert "no per-client metrics (none recorded)" in capsys.readouterr().out


def _mean_accuracy_times_two(results):  # type: ignore[no-untyped-def]
    total = sum(n for n, _ in results)
    return {"accuracy": 2 * sum(n * m["accuracy"] for n, m in results) / total,
            "reports": len(results)}


def _sites(results):  # type: ignore[no-untyped-def]
    return {"sites": ",".join(sorted(m["site"] for _, m in results)),
            "max_train_loss": np.max([m["train_loss"] for _, m in results])}


def test_the_strategys_metrics_hooks_reach_the_round_records_and_fedloom_runs(
        server_config, capsys) -> None:  # type: ignore[no-untyped-def]
    def strategy(config):  # type: ignore[no-untyped-def]
        return FedAvg(selection=config.selection, fit_metrics_aggregation_fn=_sites,
                      evaluate_metrics_aggregation_fn=_mean_accuracy_times_two)

    server, run_id = _run(server_config, strategy=strategy)
    # accuracy: 2 * (10 * 0.1 + 20 * 0.2 + 30 * 0.3) / 60 = 2 * 14 / 60
    accuracy = 2 * 14 / 60
    for record in server.coordinator.history:  # type: ignore[union-attr]
        assert record.fit == {"sites": "site-0,site-1,site-2", "max_train_loss": 0.75,
                              "num_updates": 3, "num_examples": 60}
        # the loss is fedloom's own weighted mean: (10 * 1 + 20 * 2 + 30 * 3) / 60
        assert record.evaluate == pytest.approx(
            {"accuracy": accuracy, "reports": 3, "loss": 140 / 60, "num_examples": 60})
    state_dir = server.config.state_dir
    assert main(["runs", run_id, "--state-dir", state_dir]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert last[-1] == f"{accuracy:.4f}" and last[-2] == f"{140 / 60:.4f}"
    assert main(["runs", run_id, "--json", "--state-dir", state_dir]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert run["rounds"][1]["metrics"]["fit"]["sites"] == "site-0,site-1,site-2"
    assert run["rounds"][2]["metrics"]["evaluate"]["reports"] == 3


def test_a_hook_may_report_text_where_the_displays_expect_numbers(
        server_config, capsys) -> None:  # type: ignore[no-untyped-def]
    def text(_):  # type: ignore[no-untyped-def]
        return {"train_loss": "n/a", "accuracy": "not measured"}

    def strategy(config):  # type: ignore[no-untyped-def]
        return FedAvg(selection=config.selection, fit_metrics_aggregation_fn=text,
                      evaluate_metrics_aggregation_fn=text)

    # the round log line and the live display format loss and accuracy: text must not
    # end the run after its round was committed
    server, run_id = _run(server_config, strategy=strategy, progress=True)
    assert server.coordinator.history[-1].evaluate["accuracy"] == "not measured"  # type: ignore[union-attr]
    assert main(["runs", run_id, "--state-dir", server.config.state_dir]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].split()[-1] == "-"


def test_a_differentially_private_strategy_passed_in_keeps_no_client_rows(
        server_config) -> None:  # type: ignore[no-untyped-def]
    # Privacy is off in the config: the strategy object alone says the run is private.
    def private(config):  # type: ignore[no-untyped-def]
        inner = FedAvg(selection=config.selection)
        privacy = PrivacyConfig(mode="central", noise_multiplier=1e-9, clip_norm=100.0,
                                target_epsilon=0.0)
        return CentralDPStrategy(inner, privacy, rng=np.random.default_rng(0))

    server, run_id = _run(server_config, strategy=private)
    assert not server.config.privacy.enabled
    assert _client_rows(server.config.state_dir, run_id) == {}


def test_an_evaluation_is_recorded_in_its_committed_round_with_its_rows_or_not_at_all(
        tmp_path: Path) -> None:
    store = RunStore(tmp_path / "fedloom.db")
    try:
        store.create_run("run", 3, {})
        store.commit_round(_row(1), [ClientRow("fit", "a", "site-a", 5, {"x": 1.0})])
        evaluated = [ClientRow("evaluate", "a", "site-a", 5, {"acc": 0.5}, loss=0.25),
                     ClientRow("evaluate", "b", "site-b", 7, {}, loss=0.75)]
        store.record_evaluation("run", 1, {"evaluate": {"loss": 0.5}}, 9.0, evaluated)
        (row,) = store.rounds("run")
        assert row.metrics == {"evaluate": {"loss": 0.5}} and row.finished_at == 9.0
        assert row.checkpoint == "f" and row.sha256 == "0" * 64  # the commit stands
        assert [(r.phase, r.client_id, r.loss) for r in store.client_rows("run")[1]] == [
            ("fit", "a", None), ("evaluate", "a", 0.25), ("evaluate", "b", 0.75)]
        # a round that was never committed has nothing to record into; nothing is written
        with pytest.raises(ValueError, match="round 2 of run run is not committed"):
            store.record_evaluation("run", 2, {}, 9.0, evaluated)
        assert sorted(store.client_rows("run")) == [1]
    finally:
        store.close()
