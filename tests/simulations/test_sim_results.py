"""What a run leaves on disk: the results folder is checked before training, a run
replacing an earlier one says so, and the history files carry every round field."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from fedloom.errors import ConfigError
from fedloom.simulations import runner
from fedloom.simulations.cli import main
from fedloom.simulations.runner import run_scenario
from fedloom.simulations.scenario import scenario_from_mapping

TINY = "num_clients = 4\nclients_per_round = 2\nrounds = 1\n"


def tiny_scenario(**changes: Any) -> Any:
    return scenario_from_mapping({"num_clients": 4, "clients_per_round": 2, "rounds": 1,
                                  "progress": False, **changes})


def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any attempt to build the run's job fail the test."""
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("the run started training")
    monkeypatch.setattr(runner.Job, "from_scenario", refuse)


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
