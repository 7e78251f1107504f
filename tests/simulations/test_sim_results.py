"""What a run leaves on disk: the results folder is checked before training, a run
replacing an earlier one says so, and the history files carry every round field."""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from fedloom.config import StrategyConfig
from fedloom.errors import ConfigError
from fedloom.server import load_weights
from fedloom.simulations import runner
from fedloom.simulations.cli import EXIT_STOPPED, main
from fedloom.simulations.runner import run_scenario
from fedloom.simulations.scenario import scenario_from_mapping

TINY = "num_clients = 4\nclients_per_round = 2\nrounds = 1\n"


def tiny_scenario(**changes: Any) -> Any:
    return scenario_from_mapping({"num_clients": 4, "clients_per_round": 2, "rounds": 1,
                                  "progress": False, **changes})


def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any attempt to start the run's rounds fail the test (the scenario's job and
    strategy may be built first: that validates them, and trains nothing)."""
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("the run started training")
    for engine in ("run_local", "run_local_async"):
        monkeypatch.setattr(runner, engine, refuse)


# -- the results folder, before the run ---------------------------------------------------
def test_cli_refuses_an_out_that_is_a_file_before_training(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    path, taken = tmp_path / "tiny.toml", tmp_path / "taken"
    path.write_text(TINY)
    taken.write_text("not a folder")
    no_training(monkeypatch)
    assert main([str(path), "--out", str(taken), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedloom simulate: --out: ")
    assert "is a file, not a folder" in err[0]
    assert taken.read_text() == "not a folder"


def test_run_scenario_refuses_an_unwritable_out_dir_before_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = tmp_path / "taken"
    taken.write_text("")
    no_training(monkeypatch)
    with pytest.raises(ConfigError) as caught:
        run_scenario(tiny_scenario(), taken / "inside")  # below a file: cannot be made
    assert caught.value.setting == "out_dir"


def test_a_run_replacing_earlier_results_warns_naming_them(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="fedloom.simulations.runner"):
        run_scenario(tiny_scenario(), out)
        assert not caplog.records  # a fresh folder: nothing replaced
        run_scenario(tiny_scenario(), out)
    [warning] = caplog.records
    assert "replaces history.json, history.csv, history.png, final.safetensors" in (
        warning.getMessage())


# -- a run stopped mid-way keeps what it finished -----------------------------------------
def stop_after(last: int, error: BaseException) -> Any:
    """An ``on_round`` that raises ``error`` once round ``last`` is recorded."""
    def on_round(record: Any) -> None:
        if record.round == last:
            raise error
    return on_round


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("a bug")],
                         ids=["ctrl-c", "error"])
def test_a_stopped_run_writes_its_finished_rounds_and_model(
        tmp_path: Path, error: BaseException) -> None:
    out = tmp_path / "out"
    with pytest.raises(type(error)) as caught:
        run_scenario(tiny_scenario(rounds=3), out, on_round=stop_after(2, error))
    assert caught.value.__notes__ == [
        f"rounds 0..2 and the model after round 2 are written to {out}/"]
    written = json.loads((out / "history.json").read_text())
    assert [r["round"] for r in written["rounds"]] == [0, 1, 2]
    # The model after round 2 is the one a 2-round run of the same scenario ends with.
    two_rounds = run_scenario(tiny_scenario(rounds=2), None)
    assert two_rounds.weights is not None
    assert load_weights(out / "final.safetensors").allclose(two_rounds.weights, rtol=0, atol=0)


def test_cli_ctrl_c_writes_the_finished_rounds_and_exits_stopped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    path, out = tmp_path / "tiny.toml", tmp_path / "out"
    path.write_text(TINY.replace("rounds = 1", "rounds = 3"))
    calls = []

    def evaluate(_job: Any, _weights: Any) -> dict[str, float]:
        calls.append(1)
        if len(calls) == 3:  # round 2's evaluation: rounds 0 and 1 are finished
            raise KeyboardInterrupt
        return {"test_accuracy": 0.5}

    monkeypatch.setattr(runner.Job, "central_evaluate", evaluate)
    assert main([str(path), "--out", str(out), "--no-progress"]) == EXIT_STOPPED == 75
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fedloom simulate: interrupted; rounds 0..1 and the model after "
                   f"round 1 are written to {out}/"]
    written = json.loads((out / "history.json").read_text())
    assert [r["round"] for r in written["rounds"]] == [0, 1]
    assert (out / "final.safetensors").exists()


# -- the history files carry every round field --------------------------------------------
def test_history_files_carry_status_and_the_task_counts(tmp_path: Path) -> None:
    # Over-selection 1.4 on 5 clients per round issues ceil(7.0) = 7 tasks and cancels
    # the 2 that would finish last.
    history = run_scenario(tiny_scenario(num_clients=20, clients_per_round=5, rounds=2,
                                         over_selection=1.4), tmp_path)
    expected = [(r.status, r.num_sampled, r.num_updates, r.num_cancelled)
                for r in history.rounds[1:]]
    assert expected == [("ok", 7, 5, 2)] * 2
    rounds = json.loads((tmp_path / "history.json").read_text())["rounds"]
    assert [(r["status"], r["num_sampled"], r["num_updates"], r["num_cancelled"])
            for r in rounds[1:]] == expected
    assert rounds[0]["status"] == "ok" and "num_sampled" not in rounds[0]
    with open(tmp_path / "history.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["status"], int(r["num_sampled"]), int(r["num_updates"]),
             int(r["num_cancelled"])) for r in rows[1:]] == expected


def test_a_scenario_refused_when_built_leaves_no_results_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    refused = dataclasses.replace(tiny_scenario(),
                                  strategy=StrategyConfig("fedavg", {"no_such_setting": 1}))
    with pytest.raises(ConfigError):
        run_scenario(refused, out)
    assert not out.exists()

