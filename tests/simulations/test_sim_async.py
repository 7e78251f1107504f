"""Client speeds, the virtual clock of synchronous rounds, and FedBuff on the local engine.

The asynchronous engine is checked against an independent reference: a plain numpy
event loop of the FedBuff rule (Nguyen et al., AISTATS 2022) over clients with scripted,
distinct speeds, so that the order in which updates arrive is known in advance.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from fedloom.client_sdk import Client, EvaluateOutput, FitOutput
from fedloom.config import RoundsConfig, SelectionConfig
from fedloom.errors import ConfigError
from fedloom.privacy import PrivacyConfig
from fedloom.secagg import SecAggConfig
from fedloom.server.stragglers import over_select
from fedloom.simulations.cli import _apply
from fedloom.simulations.clock import SyncClock, _over_select
from fedloom.simulations.local_async import run_local_async
from fedloom.simulations.local_engine import run_local
from fedloom.simulations.plan import client_infos
from fedloom.simulations.runner import run_scenario
from fedloom.simulations.scenario import Scenario, load_scenario, scenario_from_mapping
from fedloom.simulations.speed import SpeedModel, SpeedSpec
from fedloom.strategies import FedAvg
from fedloom.types import Config
from fedloom.weights import Weights

SCENARIOS = Path(__file__).resolve().parents[2] / "simulations" / "scenarios"
NO_EVALUATION = SelectionConfig(fraction_fit=1.0, min_fit_clients=1, fraction_evaluate=0.0)


def target(index: int) -> np.ndarray:
    return np.array([index + 1.0, -2.0 * index, 0.5], np.float64)


class PullClient(Client):
    """Moves the weights halfway to its own point ``target(i)``; ``i + 1`` examples."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.configs: list[dict] = []

    def fit(self, weights: Weights, config: Config) -> FitOutput:
        self.configs.append(dict(config))
        w = weights["w"]
        return FitOutput(Weights({"w": w + 0.5 * (target(self.index) - w)}), self.index + 1,
                         {"train_loss": float(self.index)})

    def evaluate(self, weights: Weights, config: Config) -> EvaluateOutput:
        return EvaluateOutput(0.0, 1, {})


def initial() -> Weights:
    return Weights({"w": np.zeros(3, np.float64)})


# -- speeds -----------------------------------------------------------------------------

def test_speeds_are_seeded_and_follow_the_spec() -> None:
    spec = SpeedSpec(distribution="lognormal", mean_s=2.0, sigma=0.5, jitter=0.3,
                     straggler_fraction=0.2, straggler_factor=10.0)
    a = SpeedModel.from_spec(spec, num_clients=50, seed=3)
    b = SpeedModel.from_spec(spec, num_clients=50, seed=3)
    c = SpeedModel.from_spec(spec, num_clients=50, seed=4)
    assert np.array_equal(a.mean_s, b.mean_s) and a.stragglers == b.stragglers
    assert not np.array_equal(a.mean_s, c.mean_s)
    assert len(a.stragglers) == 10  # round(0.2 * 50), exactly
    assert a.duration(7, 1) == b.duration(7, 1) != a.duration(7, 2)  # jitter per fit
    # Constant speeds: every client takes mean_s, a straggler factor times more.
    constant = SpeedModel.from_spec(SpeedSpec(mean_s=2.0, straggler_fraction=0.2), 50, 3)
    assert constant.stragglers == a.stragglers  # its own random stream: sigma moves nothing
    for i in range(50):
        assert constant.duration(i, 1) == (20.0 if i in constant.stragglers else 2.0)
    # The lognormal's mean is mean_s: mu = ln(mean_s) - sigma^2 / 2 (many clients).
    many = SpeedModel.from_spec(SpeedSpec(distribution="lognormal", mean_s=2.0, sigma=0.5),
                                40_000, 0)
    assert math.isclose(float(many.mean_s.mean()), 2.0, rel_tol=0.02)


# -- synchronous rounds on the virtual clock ---------------------------------------------

DURATIONS = [3.0, 1.0, 4.5, 2.0, 6.0, 0.5, 5.0, 2.5]


def test_a_sync_round_lasts_until_its_slowest_sampled_client() -> None:
    clients = [PullClient(i) for i in range(8)]
    strategy = FedAvg(selection=SelectionConfig(fraction_fit=0.5, min_fit_clients=4,
                                                fraction_evaluate=0.0, seed=2))
    history = run_local(strategy, clients.__getitem__, initial(), num_clients=8,
                        num_rounds=3, clock=SyncClock(SpeedModel(DURATIONS)))
    now, expected = 0.0, initial()["w"]
    assert history.rounds[0].get("virtual_time_s") == 0.0
    for r in (1, 2, 3):
        trained = [c.index for c in clients if any(x["server_round"] == r for x in c.configs)]
        assert len(trained) == 4
        now += max(DURATIONS[i] for i in trained)
        assert history.rounds[r].get("virtual_time_s") == pytest.approx(now, abs=1e-12)
        n = np.array([i + 1.0 for i in trained])
        deltas = np.array([0.5 * (target(i) - expected) for i in trained])
        expected = expected + (n[:, None] * deltas).sum(axis=0) / n.sum()
    assert history.weights is not None
    np.testing.assert_allclose(history.weights["w"], expected, rtol=1e-12)


def test_over_selection_closes_the_round_at_the_mth_arrival() -> None:
    clients = [PullClient(i) for i in range(8)]
    strategy = FedAvg(selection=SelectionConfig(fraction_fit=0.5, min_fit_clients=4,
                                                fraction_evaluate=0.0, seed=2))
    clock = SyncClock(SpeedModel(DURATIONS), over_selection=1.5, seed=9)
    history = run_local(strategy, clients.__getitem__, initial(), num_clients=8,
                        num_rounds=2, clock=clock)
    planned = FedAvg(selection=SelectionConfig(fraction_fit=0.5, min_fit_clients=4,
                                               fraction_evaluate=0.0, seed=2))
    now = 0.0
    for r in (1, 2):
        plan = planned.configure_fit(r, initial(), client_infos(8)).client_ids
        issued = over_select(plan, client_infos(8), 1.5, seed=9, server_round=r).client_ids
        assert len(issued) == 6  # ceil(4 * 1.5)
        fastest = sorted(issued, key=lambda cid: DURATIONS[int(cid)])[:4]
        trained = [c.index for c in clients if any(x["server_round"] == r for x in c.configs)]
        assert sorted(trained) == sorted(int(cid) for cid in fastest)  # the rest never train
        now += sorted(DURATIONS[int(cid)] for cid in issued)[3]  # the 4th arrival
        record = history.rounds[r]
        assert record.get("virtual_time_s") == pytest.approx(now, abs=1e-12)
        assert (record.num_sampled, record.num_cancelled, record.num_updates) == (6, 2, 4)


@pytest.mark.parametrize("factor", [1.0, 1.3, 1.5, 3.0])
def test_the_extra_clients_are_drawn_as_the_server_draws_them(factor: float) -> None:
    infos = client_infos(20)
    for r in range(1, 6):
        plan = tuple(str(i) for i in range(r, 20, 4))
        ours = _over_select(plan, infos, factor, seed=5, server_round=r)
        assert ours == over_select(plan, infos, factor, seed=5, server_round=r).client_ids


# -- FedBuff -------------------------------------------------------------------------------

def fedbuff_reference(speeds: list[float], *, buffer_size: int, max_staleness: int,
                      exponent: float, versions: int) -> dict:
    """FedBuff by hand: every client trains all the time (concurrency = clients), so
    client i's k-th result arrives at k * speeds[i]; no fedloom code involved."""
    events = sorted((k * s, i) for i, s in enumerate(speeds) for k in range(1, 200))
    models = [np.zeros(3)]
    start = [0] * len(speeds)  # the version each client trains on
    buffer: list[tuple[float, np.ndarray]] = []
    times: list[float] = [0.0]
    refused: list[int] = [0]
    stalenesses: list[list[tuple[float, int]]] = [[]]  # (examples, staleness) per buffer
    for when, i in events:
        v = len(models) - 1
        s = v - start[i]
        if s > max_staleness:
            refused[-1] += 1
        else:
            delta = 0.5 * (target(i) - models[start[i]])
            buffer.append((i + 1.0, (1.0 + s) ** -exponent * delta))
            stalenesses[-1].append((i + 1.0, s))
        if len(buffer) == buffer_size:
            n = np.array([b[0] for b in buffer])
            mean = (n[:, None] * np.array([b[1] for b in buffer])).sum(axis=0) / n.sum()
            models.append(models[-1] + mean)
            times.append(when)
            buffer = []
            if len(models) - 1 == versions:
                break
            refused.append(0)
            stalenesses.append([])
        start[i] = len(models) - 1  # the returned client restarts on the newest model
    return {"models": models, "times": times, "refused": refused,
            "stalenesses": stalenesses}


def test_fedbuff_matches_a_numpy_reference() -> None:
    speeds = [1.0, 1.37, 1.81, 2.93, 9.7]  # distinct: no two results arrive together
    clients = [PullClient(i) for i in range(5)]
    rounds = RoundsConfig(mode="async", concurrency=5, buffer_size=3, max_staleness=3,
                          staleness_weighting="polynomial", staleness_exponent=0.5)
    history = run_local_async(FedAvg(selection=NO_EVALUATION), clients.__getitem__,
                              initial(), num_clients=5, num_rounds=12, rounds=rounds,
                              speed=SpeedModel(speeds), base_seed=1)
    ref = fedbuff_reference(speeds, buffer_size=3, max_staleness=3, exponent=0.5, versions=12)
    assert [r.round for r in history.rounds] == list(range(13))
    # Not vacuous: the slow client is refused, and stale updates are weighted down.
    assert sum(ref["refused"]) > 0
    assert any(s > 0 for buffer in ref["stalenesses"] for _, s in buffer)
    for v in range(1, 13):
        record = history.rounds[v]
        assert record.get("virtual_time_s") == pytest.approx(ref["times"][v], abs=1e-9)
        assert record.num_updates == 3 and record.num_failures == ref["refused"][v - 1]
        n, s = np.array(ref["stalenesses"][v - 1]).T  # the strategy's mean of the metric
        assert record.get("staleness") == pytest.approx(float((n * s).sum() / n.sum()))
    assert history.weights is not None
    np.testing.assert_allclose(history.weights["w"], ref["models"][12], rtol=1e-12)


def test_stale_updates_are_refused_without_training() -> None:
    # Client 0 returns every second, client 1 after 2.5 s; K = 1, max_staleness = 0:
    # t=1 and t=2 make versions 1 and 2; client 1's update on version 0 is 2 versions old.
    clients = [PullClient(0), PullClient(1)]
    rounds = RoundsConfig(mode="async", concurrency=2, buffer_size=1, max_staleness=0,
                          total_updates=3)
    history = run_local_async(FedAvg(selection=NO_EVALUATION), clients.__getitem__,
                              initial(), num_clients=2, num_rounds=10, rounds=rounds,
                              speed=SpeedModel([1.0, 2.5]))
    assert [r.round for r in history.rounds] == [0, 1, 2, 3]  # total_updates ends it
    assert [r.get("virtual_time_s") for r in history.rounds] == [0.0, 1.0, 2.0, 3.0]
    assert [r.num_failures for r in history.rounds[1:]] == [0, 0, 1]
    assert [r.get("staleness") for r in history.rounds[1:]] == [0, 0, 0]
    # Client 1's only result came too late: refused before its fit ever ran.
    assert clients[1].configs == [] and len(clients[0].configs) == 3
    # Each task of a client has its own seed (its n-th task), not one per version.
    assert len({c["seed"] for c in clients[0].configs}) == 3


def test_async_scenarios_are_deterministic() -> None:
    scenario = Scenario(
        num_clients=10, clients_per_round=3, rounds=4, seed=3, progress=False,
        evaluate_clients_per_round=2,
        speed=SpeedSpec(distribution="lognormal", jitter=0.3, straggler_fraction=0.3),
        rounds_config=RoundsConfig(mode="async", concurrency=4, buffer_size=3,
                                   max_staleness=2, evaluate_every=2))
    first, second = run_scenario(scenario, None), run_scenario(scenario, None)
    assert first.weights is not None and second.weights is not None
    assert first.weights.allclose(second.weights, rtol=0, atol=0)
    for a, b in zip(first.rounds, second.rounds, strict=True):
        assert {k: v for k, v in a.metrics.items() if k != "seconds"} == {
            k: v for k, v in b.metrics.items() if k != "seconds"}
    assert [r.round for r in first.rounds] == [0, 1, 2, 3, 4]
    evaluated = [r.round for r in first.rounds if r.get("test_accuracy") is not None]
    assert evaluated == [0, 2, 4]  # evaluate_every = 2, and the last
    assert first.rounds[2].get("federated_loss") is not None
    times = [r.get("virtual_time_s") for r in first.rounds]
    assert times == sorted(times) and times[-1] > 0
    other = run_scenario(scenario.replace(seed=4), None)
    assert other.rounds[-1].get("virtual_time_s") != times[-1]


# -- scenarios: settings, errors, files ------------------------------------------------------

ASYNC_TOML = """
num_rounds = 7
num_clients = 20
clients_per_round = 5

[rounds]
mode = "async"
concurrency = 8
buffer_size = 4

[speed]
distribution = "lognormal"
straggler_fraction = 0.2
"""


def test_a_scenario_takes_the_servers_rounds_table(tmp_path: Path) -> None:
    path = tmp_path / "a.toml"
    path.write_text(ASYNC_TOML)
    s = load_scenario(path)
    assert s.rounds == 7 and s.rounds_config.asynchronous and s.rounds_config.concurrency == 8
    assert s.speed.distribution == "lognormal" and s.speed.straggler_fraction == 0.2
    assert s.to_dict()["rounds_config"]["buffer_size"] == 4
    total = scenario_from_mapping({"num_rounds": 50, "rounds": {"mode": "async",
                                                                 "buffer_size": 4,
                                                                 "total_updates": 10}})
    assert total.last_round == 3  # ceil(10 / 4) versions
    assert scenario_from_mapping({"rounds": 3}).rounds == 3  # the plain form still works
    # --set rounds.mode=async on a file that says rounds = N moves N to num_rounds.
    data: dict = {"rounds": 9}
    _apply(data, "rounds.mode=async")
    assert scenario_from_mapping(data).rounds == 9
    assert scenario_from_mapping(data).rounds_config.asynchronous


def test_the_async_scenario_file_loads() -> None:
    s = load_scenario(SCENARIOS / "digits_async.toml")
    assert s.engine == "local" and s.rounds_config.asynchronous
    assert s.speed.straggler_fraction > 0 and s.num_clients == 100


@pytest.mark.parametrize(("data", "setting", "words"), [
    ({"engine": "flower", "rounds": {"mode": "async"}}, "engine", "local engine"),
    ({"rounds": {"mode": "async"}, "secure_aggregation": {"enabled": True}},
     "rounds.mode", "secure aggregation"),
    ({"rounds": {"mode": "async"}, "privacy": {"mode": "central", "noise_multiplier": 1.0}},
     "rounds.mode", "differential privacy"),
    ({"rounds": {"mode": "async"}, "over_selection": 1.3}, "over_selection", "no use"),
    ({"rounds": {"mode": "asynchronous"}}, "rounds.mode", "must be one of"),
    ({"rounds": {"concurency": 3}}, "rounds.concurency", "did you mean 'concurrency'"),
    ({"rounds": 3, "num_rounds": 4}, "num_rounds", "same setting"),
    ({"over_selection": 0.5}, "over_selection", ">= 1"),
    ({"over_selection": 1.3, "secure_aggregation": {"enabled": True}}, "over_selection",
     "secure"),
    ({"speed": {"distribution": "uniform"}}, "speed.distribution", "lognormal"),
    ({"speed": {"mean_s": 0}}, "speed.mean_s", "> 0"),
    ({"speed": {"sigma": -1}}, "speed.sigma", ">= 0"),
    ({"speed": {"jitter": -0.1}}, "speed.jitter", ">= 0"),
    ({"speed": {"straggler_fraction": 1.5}}, "speed.straggler_fraction", "[0, 1]"),
    ({"speed": {"straggler_factor": 0.5}}, "speed.straggler_factor", ">= 1"),
])
def test_bad_settings_are_refused_naming_them(data: dict, setting: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        scenario_from_mapping({"num_clients": 10, "clients_per_round": 8, **data})
    assert info.value.setting == setting and words in info.value.problem


def test_async_refusals_hold_for_objects_too() -> None:
    asynchronous = RoundsConfig(mode="async")
    with pytest.raises(ConfigError, match="local engine"):
        Scenario(engine="flower", rounds_config=asynchronous)
    with pytest.raises(ConfigError, match="secure aggregation"):
        Scenario(rounds_config=asynchronous, num_clients=10, clients_per_round=8,
                 secure_aggregation=SecAggConfig(enabled=True, neighbours=6, threshold=4))
    with pytest.raises(ConfigError, match="differential privacy"):
        Scenario(rounds_config=asynchronous,
                 privacy=PrivacyConfig(mode="central", noise_multiplier=1.0))


# -- records, evaluation, plots ----------------------------------------------------------

def test_evaluate_every_and_the_virtual_time_reach_the_files(tmp_path: Path) -> None:
    scenario = Scenario(num_clients=6, clients_per_round=3, rounds=5, progress=False,
                        speed=SpeedSpec(mean_s=2.0),
                        rounds_config=RoundsConfig(evaluate_every=2))
    history = run_scenario(scenario, tmp_path)
    assert [r.round for r in history.rounds if r.get("test_accuracy") is not None] == [
        0, 2, 4, 5]
    # Constant speeds of 2 s, no over-selection: every round takes 2 s.
    assert history.series("virtual_time_s") == [(r, 2.0 * r) for r in range(6)]
    assert [t for t, _ in history.over_time("test_accuracy")] == [0.0, 4.0, 8.0, 10.0]
    header = (tmp_path / "history.csv").read_text().splitlines()[0]
    assert "virtual_time_s" in header.split(",")
    assert len(history.figure().get_axes()) == 3  # accuracy against virtual time too
