"""`fedloom runs`: past runs and their per-round metrics from the run database."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from helpers import ScriptedClient, run_clients, small_weights

from fedloom.cli import main
from fedloom.server import Server


def _one_run(server_config, **overrides) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    config = server_config(num_rounds=2, **overrides)
    handle = Server(config, initial_weights=small_weights()).start()
    clients = [ScriptedClient(seed=i, num_examples=10) for i in range(3)]
    threads = run_clients(handle.address, clients)
    history = handle.wait(60)
    for t in threads:
        t.join(10)
    assert [r.status for r in history] == ["ok", "ok"]
    coordinator = handle.server.coordinator
    assert coordinator is not None
    return config.state_dir, coordinator.run_id


def test_runs_lists_each_run_and_one_runs_rounds(server_config, capsys) -> None:
    state_dir, run_id = _one_run(server_config)
    assert main(["runs", "--state-dir", state_dir]) == 0
    out = capsys.readouterr().out
    header, row = out.strip().splitlines()
    assert header.split() == ["RUN", "STATUS", "ROUNDS", "STARTED", "LOSS", "ACCURACY"]
    assert row.split()[:3] == [run_id, "finished", "2/2"]
    # ScriptedClient.evaluate: accuracy 0.5 from every client
    assert row.split()[-1] == "0.5000"

    assert main(["runs", run_id[:12], "--state-dir", state_dir]) == 0  # a prefix will do
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"run {run_id} (finished, 2 of 2 rounds committed)"
    assert lines[1].split()[:7] == [
        "ROUND",
        "STATUS",
        "SAMPLED",
        "UPDATES",
        "FAILED",
        "CANCELLED",
        "SECONDS",
    ]
    assert [line.split()[:6] for line in lines[2:]] == [
        ["1", "ok", "3", "3", "0", "0"],
        ["2", "ok", "3", "3", "0", "0"],
    ]


def test_runs_json_holds_every_round_metric(server_config, capsys) -> None:
    state_dir, run_id = _one_run(server_config)
    assert main(["runs", "--state-dir", state_dir, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    (run,) = document["runs"]
    assert run["run_id"] == run_id and run["status"] == "finished"
    assert [r["round"] for r in run["rounds"]] == [0, 1, 2]  # round 0: the initial model
    fit = run["rounds"][1]["metrics"]["fit"]
    assert fit["num_updates"] == 3 and fit["num_examples"] == 30
    assert run["rounds"][2]["metrics"]["evaluate"]["accuracy"] == 0.5


def test_runs_reads_state_dir_from_a_config_file(server_config, capsys, tmp_path) -> None:
    state_dir, run_id = _one_run(server_config)
    toml = tmp_path / "server.toml"
    toml.write_text(f'state_dir = "{state_dir}"\n')
    assert main(["runs", "--config", str(toml)]) == 0
    assert run_id in capsys.readouterr().out


def test_runs_opens_the_database_read_only(server_config, capsys) -> None:
    state_dir, _ = _one_run(server_config)
    db = Path(state_dir) / "fedloom.db"
    before = db.stat().st_mtime_ns
    assert main(["runs", "--state-dir", state_dir]) == 0
    capsys.readouterr()
    assert db.stat().st_mtime_ns == before
    from fedloom.server.run_report import open_store

    store = open_store(state_dir)
    try:
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            store._db.execute("DELETE FROM rounds")
    finally:
        store.close()


def test_runs_explains_a_missing_database_or_an_unknown_run(
    server_config, capsys, tmp_path
) -> None:
    assert main(["runs", "--state-dir", str(tmp_path / "nowhere")]) == 2
    assert "no run database" in capsys.readouterr().err
    state_dir, _ = _one_run(server_config)
    assert main(["runs", "zzz", "--state-dir", state_dir]) == 2
    assert "'zzz' matches no run" in capsys.readouterr().err
