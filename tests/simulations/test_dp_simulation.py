"""``[privacy] mode = "central"`` in simulated runs: ε each round, and the budget stops
the run (the local engine, and Flower's engine under the ``flower`` marker).

Three of six clients each round, sampled without replacement (``sampling = "fixed"``):
the expected ε of k rounds is dp-accounting's on k events
``SampledWithoutReplacementDpEvent(6, 3, GaussianDpEvent(z / 2))`` (replace-one; the
clipped sum's sensitivity is 2C), computed here.
"""

from __future__ import annotations

import functools
import logging

import dp_accounting
import pytest
from dp_accounting.rdp import rdp_privacy_accountant
from test_sim_flower import _run_flower_scenario  # retries only a timed-out Ray start

from fedloom.privacy import PrivacyConfig
from fedloom.simulations.history import History
from fedloom.simulations.runner import run_scenario
from fedloom.simulations.scenario import FlowerSpec, Scenario

logging.getLogger("absl").setLevel(logging.ERROR)

NUM_CLIENTS, PER_ROUND, Z, DELTA = 6, 3, 2.0, 1e-5
ALLOWED = 3  # the budget lies between the epsilon of 3 and of 4 rounds


@functools.cache
def expected_epsilons(rounds: int) -> tuple[float, ...]:
    """ε after each of ``rounds`` rounds, from dp-accounting directly."""
    accountant = rdp_privacy_accountant.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    event = dp_accounting.SampledWithoutReplacementDpEvent(
        NUM_CLIENTS, PER_ROUND, dp_accounting.GaussianDpEvent(Z / 2))
    out = []
    for _ in range(rounds):
        accountant.compose(event)
        out.append(float(accountant.get_epsilon(DELTA)))
    return tuple(out)


def scenario(engine: str = "local") -> Scenario:
    eps = expected_epsilons(ALLOWED + 1)
    privacy = PrivacyConfig(mode="central", noise_multiplier=Z, clip_norm=1.0, delta=DELTA,
                            target_epsilon=(eps[ALLOWED - 1] + eps[ALLOWED]) / 2)
    return Scenario(name="dp", engine=engine, num_clients=NUM_CLIENTS,
                    clients_per_round=PER_ROUND, rounds=6, progress=False, seed=1,
                    privacy=privacy, flower=FlowerSpec(num_cpus=1.0))


def private_rounds(history: History) -> list[tuple[int, float]]:
    return history.series("privacy_epsilon")


def check_stopped_at_the_budget(history: History) -> None:
    eps = expected_epsilons(ALLOWED + 1)
    target = scenario().privacy.target_epsilon
    rounds = private_rounds(history)
    assert [r for r, _ in rounds] == list(range(1, ALLOWED + 1))
    for (_, got), want in zip(rounds, eps, strict=False):
        assert got == pytest.approx(want, rel=1e-9)
    assert rounds[-1][1] <= target < eps[ALLOWED]
    for r in history.rounds[1:ALLOWED + 1]:
        assert r.get("num_updates") == PER_ROUND and r.get("noise_multiplier") == Z


def test_local_engine_records_epsilon_and_stops_at_the_budget() -> None:
    history = run_scenario(scenario(), None)
    check_stopped_at_the_budget(history)
    # The run ends after the last allowed round: no record past it.
    assert [r.round for r in history.rounds] == list(range(ALLOWED + 1))
    assert history.weights is not None


@pytest.mark.flower
def test_flower_engine_records_epsilon_and_stops_at_the_budget() -> None:
    history = _run_flower_scenario(scenario("flower"))
    assert history.engine == "flower"
    check_stopped_at_the_budget(history)
    # Flower's loop runs its rounds; none past the budget trains or changes the model.
    for r in history.rounds[ALLOWED + 1:]:
        assert r.get("privacy_epsilon") is None and not r.get("num_updates")
    finals = [r.get("test_accuracy") for r in history.rounds[ALLOWED:]]
    assert len(set(finals)) == 1  # the model of the last allowed round, unchanged
