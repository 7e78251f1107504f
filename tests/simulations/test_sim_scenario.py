"""Scenario TOML: defaults, validation naming the setting, overrides from the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedloom.config import SelectionConfig
from fedloom.errors import ConfigError
from fedloom.simulations.cli import _apply, main
from fedloom.simulations.scenario import (
    PartitionSpec,
    Scenario,
    load_scenario,
    scenario_from_mapping,
)

FULL = """
seed = 3
engine = "flower"
num_clients = 20
clients_per_round = 5
rounds = 2
local_epochs = 2

[dataset]
name = "digits"
test_fraction = 0.25

[partition]
name = "dirichlet"
alpha = 0.3
min_size = 4

[client]
batch_size = 16
lr = 0.1

[strategy]
name = "fedavg"

[flower]
num_cpus = 2
num_gpus = 0.5
ray_address = "auto"
"""


def test_load_full_scenario(tmp_path: Path) -> None:
    path = tmp_path / "my-run.toml"
    path.write_text(FULL)
    s = load_scenario(path)
    assert s.name == "my-run" and s.engine == "flower" and s.seed == 3
    assert s.partition.name == "dirichlet" and s.partition.alpha == 0.3
    assert s.client.lr == 0.1 and s.flower.num_cpus == 2.0
    assert s.strategy.name == "fedavg" and dict(s.strategy.params) == {}
    assert s.flower.backend_config() == {
        "client_resources": {"num_cpus": 2.0, "num_gpus": 0.5},
        "init_args": {"address": "auto"},
    }
    assert s.selection == SelectionConfig(fraction_fit=0.25, min_fit_clients=5,
                                          fraction_evaluate=0.0, min_evaluate_clients=0, seed=3)


def test_defaults_resolve_partition() -> None:
    assert Scenario().partition_name == "iid"
    synthetic = scenario_from_mapping({"dataset": {"name": "synthetic"}})
    assert synthetic.partition_name == "natural"


@pytest.mark.parametrize(
    ("data", "setting"),
    [
        ({"engine": "ray"}, "engine"),
        ({"num_clients": 4, "clients_per_round": 5}, "clients_per_round"),
        ({"rounds": 0}, "rounds"),
        ({"rounds": "3"}, "rounds"),
        ({"roundz": 3}, "roundz"),
        ({"partition": {"alpha": 0.0}}, "partition.alpha"),
        ({"partition": {"name": "natural"}}, "partition.name"),
        ({"dataset": {"name": "synthetic"}, "partition": {"name": "iid"}}, "partition.name"),
        ({"dataset": {"name": "mnist"}}, "dataset.name"),
        ({"client": {"lr": -1.0}}, "client.lr"),
        ({"flower": {"num_cpus": 0}}, "flower.num_cpus"),
        ({"client": {"batch": 3}}, "client.batch"),
    ],
)
def test_bad_settings_name_the_setting(data: dict, setting: str) -> None:
    with pytest.raises(ConfigError) as err:
        scenario_from_mapping(data)
    assert err.value.setting == setting


def test_unknown_key_suggests_the_right_one() -> None:
    with pytest.raises(ConfigError, match="did you mean 'rounds'"):
        scenario_from_mapping({"roundz": 3})


def test_cli_set_parses_toml_values() -> None:
    data: dict = {}
    for assignment in ("client.lr=0.5", "engine=flower", "rounds=4", 'name="x"'):
        _apply(data, assignment)
    assert data == {"client": {"lr": 0.5}, "engine": "flower", "rounds": 4, "name": "x"}


def test_cli_reports_bad_scenarios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.toml"
    path.write_text("rounds = 1\n[strategy]\nname = 'fedavgg'\n")
    assert main([str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert "did you mean 'fedavg'" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.toml")]) == 2


def test_cli_runs_a_scenario(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text("num_clients = 4\nclients_per_round = 2\nrounds = 1\n")
    out = tmp_path / "out"
    assert main([str(path), "--out", str(out), "--no-progress", "--set", "seed=2"]) == 0
    assert {p.name for p in out.iterdir()} >= {
        "history.json", "history.csv", "history.png", "final.safetensors"
    }
    assert "tiny: 1 rounds on local" in capsys.readouterr().out


def test_client_optimizer_adam_trains_and_unknown_is_refused():
    import torch

    from fedloom.simulations.job import Job

    scenario = scenario_from_mapping({"num_clients": 4, "clients_per_round": 2, "rounds": 1,
                                      "client": {"optimizer": "adam"}})
    assert scenario.client.optimizer == "adam"
    client = Job.from_scenario(scenario).make_client(0)
    assert isinstance(client.optimizer_factory(client.model.parameters()), torch.optim.Adam)
    with pytest.raises(ConfigError, match=r"client\.optimizer.*'rmsprop' is not one of sgd, adam"):
        scenario_from_mapping({"client": {"optimizer": "rmsprop"}})


def test_engine_table_gives_the_name_and_options():
    s = scenario_from_mapping({"engine": {"name": "local", "workers": 3}})
    assert (s.engine, s.engine_options.workers, s.engine_options.chunk_size) == ("local", 3, 64)
    s = scenario_from_mapping({"engine": {"name": "vectorized", "chunk_size": 16}})
    assert (s.engine, s.engine_options.chunk_size) == ("vectorized", 16)
    assert scenario_from_mapping({"engine": "vectorized"}).engine_options.workers == 1


@pytest.mark.parametrize(("engine", "match"), [
    ({"name": "local", "workers": 0}, r"engine\.workers.*at least 1"),
    ({"name": "local", "chunk_size": 0}, r"engine\.chunk_size.*at least 1"),
    ({"name": "local", "threads": 2}, r"engine\.threads.*\"vectorized\" only.*threads = 1"),
    ({"name": "local", "gpus": 2}, r"engine\.gpus.*unknown setting"),
    ({"name": "vectorized", "workers": 2}, r"engine\.workers.*'vectorized'.*workers = 1"),
    ({"name": "flower", "workers": 2}, r"engine\.workers.*'flower'"),
])
def test_engine_table_refuses_what_an_engine_cannot_do(engine, match):
    with pytest.raises(ConfigError, match=match):
        scenario_from_mapping({"engine": engine})


def test_async_rounds_refuse_worker_processes():
    with pytest.raises(ConfigError, match=r"one process only.*workers = 1"):
        scenario_from_mapping({"num_rounds": 3, "rounds": {"mode": "async", "concurrency": 2},
                               "engine": {"name": "local", "workers": 2}})


def test_cli_engine_flags_keep_the_engine_table():
    data = {"engine": {"name": "local", "chunk_size": 8}}
    _apply(data, "engine=vectorized")
    assert data == {"engine": {"name": "vectorized", "chunk_size": 8}}
    data = {"engine": "local"}
    _apply(data, "engine.workers=2")
    assert scenario_from_mapping(data).engine_options.workers == 2
    data = {"engine": "vectorized"}
    _apply(data, "engine.threads=2")
    assert scenario_from_mapping(data).engine_options.threads == 2


@pytest.mark.parametrize(("strategy", "need"), [
    ({"name": "krum", "num_malicious_nodes": 2}, 7),  # n > 2f + 2
    ({"name": "multikrum", "num_malicious_nodes": 1, "num_nodes_to_select": 6}, 6),
    ({"name": "bulyan", "num_malicious_nodes": 1}, 7),  # n >= 4f + 3
    ({"name": "fedtrimmedavg", "beta": 0.1}, 10),  # int(0.1 * n) >= 1 from n = 10
    ({"name": "fedtrimmedavg"}, 5),  # its default beta, 0.2
])
def test_robust_strategies_short_of_clients_are_refused_at_start(
        strategy: dict, need: int) -> None:
    base = {"num_clients": 20, "strategy": strategy}
    with pytest.raises(ConfigError) as caught:
        scenario_from_mapping({**base, "clients_per_round": need - 1})
    assert caught.value.setting == "clients_per_round"
    assert f"must be at least {need} for strategy {strategy['name']!r}" in str(caught.value)
    assert "raise clients_per_round" in str(caught.value)
    assert "min_fit_clients" not in str(caught.value)
    with pytest.raises(ConfigError, match=f"must be at least {need}"):  # wrapped by the bound
        scenario_from_mapping({**base, "clients_per_round": need - 1,
                               "strategy": {**strategy, "max_update_norm": 1.0}})
    scenario_from_mapping({**base, "clients_per_round": need})  # enough: accepted
    unchecked = {**strategy, "enforce_preconditions": False}  # Flower's unchecked rule
    if strategy["name"] == "bulyan":  # below 4f + 3 it makes no model, checked or not
        with pytest.raises(ConfigError, match="must be at least 7 for strategy 'bulyan'"):
            scenario_from_mapping({**base, "clients_per_round": need - 1,
                                   "strategy": unchecked})
    else:
        scenario_from_mapping({**base, "clients_per_round": need - 1, "strategy": unchecked})


@pytest.mark.parametrize(("partition", "setting", "text"), [
    ({"name": "dirichlet", "alpha": 0.01, "min_size": 5, "max_retries": 2},
     "partition.min_size", "gave every client at least 5 examples"),
    ({"name": "shards", "shards_per_client": 200},
     "partition.shards_per_client", "4000 shards exceed the"),
])
def test_partition_errors_name_the_scenario_key(partition: dict, setting: str,
                                                text: str) -> None:
    from fedloom.simulations.job import Job

    scenario = scenario_from_mapping({"num_clients": 20, "clients_per_round": 5,
                                      "partition": partition})
    with pytest.raises(ConfigError) as caught:
        Job.from_scenario(scenario)
    assert caught.value.setting == setting
    assert str(caught.value).startswith(f"{setting}: ") and text in str(caught.value)


def test_secure_dropout_without_secure_aggregation_is_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        scenario_from_mapping({"secure_dropout": {"fraction": 0.5}})
    assert caught.value.setting == "secure_dropout.fraction"
    assert "secure_aggregation.enabled = true" in str(caught.value)
    scenario_from_mapping({"secure_dropout": {"fraction": 0.0}})  # the default: no effect


@pytest.mark.parametrize(("changes", "setting", "problem"), [
    ({"rounds": 2.5}, "rounds", "must be an integer, got 2.5"),
    ({"seed": "1"}, "seed", "must be an integer, got '1'"),
    ({"clients_per_round": 2.0}, "clients_per_round", "must be an integer, got 2.0"),
    ({"over_selection": "1.3"}, "over_selection", "must be a number, got '1.3'"),
    ({"partition": {"alpha": "x"}}, "partition.alpha", "must be a number, got 'x'"),
])
def test_python_and_toml_scenarios_refuse_wrong_types_alike(
        changes: dict, setting: str, problem: str) -> None:
    def in_python() -> Scenario:
        if "partition" in changes:  # a table is built as its own dataclass
            return Scenario(partition=PartitionSpec(**changes["partition"]))
        return Scenario(**changes)

    for build in (lambda: scenario_from_mapping(changes), in_python):
        with pytest.raises(ConfigError) as caught:
            build()
        assert (caught.value.setting, caught.value.problem) == (setting, problem)


def test_a_python_scenario_refuses_a_plain_mapping_for_a_table() -> None:
    with pytest.raises(ConfigError) as caught:
        Scenario(partition={"name": "iid"})  # type: ignore[arg-type]
    assert caught.value.setting == "partition"
    assert "must be a PartitionSpec, got dict" in str(caught.value)


def test_numpy_numbers_in_a_python_scenario_become_python_values() -> None:
    """A sweep over ``np.arange`` hands numpy scalars; the scenario (and the history that
    records it) must be plain data, or history.json fails after the whole run."""
    scenario = Scenario(num_clients=np.int64(8), clients_per_round=np.int64(4),
                        over_selection=np.float64(1.0), progress=np.bool_(False),
                        partition=PartitionSpec(name="dirichlet", alpha=np.float32(0.5)))
    values = (scenario.num_clients, scenario.clients_per_round, scenario.over_selection,
              scenario.progress, scenario.partition.alpha)
    assert [type(v) for v in values] == [int, int, float, bool, float]
    json.dumps(scenario.to_dict(), allow_nan=False)


def test_an_asynchronous_scenario_ignores_the_synchronous_cohort_size() -> None:
    """clients_per_round sizes synchronous rounds; an asynchronous scenario with fewer
    clients than its (default) cohort runs, where it was refused."""
    scenario = scenario_from_mapping({"num_clients": 8, "rounds": {"mode": "async",
                                                                   "concurrency": 4,
                                                                   "buffer_size": 2}})
    assert scenario.clients_per_round == 10 and scenario.selection.min_fit_clients == 8
    with pytest.raises(ConfigError, match="clients_per_round"):
        scenario_from_mapping({"num_clients": 8})  # a synchronous cohort must fit
