"""Poisoning, small and fast: 20 clients on a fixed IID partition of digits, all in every
round, 4 of them attackers; the robust strategies keep at least 90% of FedAvg's clean
accuracy while FedAvg falls to 50% of it or below.

The same experiment as ``benchmarks/strategies.py --part poisoning`` (same data,
partition, attackers and local engine), with the numpy softmax-regression client
instead of the MLP and 12 rounds, so it takes seconds. Accuracy is the mean central
test accuracy of the last 3 rounds.

Attacks (see ``benchmarks/strategies_experiments.py``): ``sign_flip`` sends -10 times
the honest delta; ``noise1000`` sends Gaussian noise 1000 times the honest delta's norm;
``inflate`` trains on shifted labels and claims 100x its examples. ``noise`` (10x, the
sign-flipped update's norm) is not enough to break FedAvg — zero-mean noise averages
out — so for it only the robust strategies' side is asserted.
"""

from __future__ import annotations

import functools
import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")  # fedloom.simulations' data pipeline imports it

from fedloom.config import SelectionConfig
from fedloom.strategies import Bulyan, FedAvg, FedMedian, FedTrimmedAvg, Krum, MultiKrum

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
experiments: Any = importlib.import_module("strategies_experiments")

ROUNDS = 12
F = 4
ROBUST = {
    "fedmedian": lambda: FedMedian(selection=SelectionConfig(fraction_evaluate=0.0)),
    "fedtrimmedavg": lambda: FedTrimmedAvg(beta=0.2,
                                           selection=SelectionConfig(fraction_evaluate=0.0)),
    "krum": lambda: Krum(num_malicious_nodes=F, selection=SelectionConfig(fraction_evaluate=0.0)),
    "multikrum": lambda: MultiKrum(num_malicious_nodes=F, num_nodes_to_select=20 - F,
                                   selection=SelectionConfig(fraction_evaluate=0.0)),
    "bulyan": lambda: Bulyan(num_malicious_nodes=F,
                             selection=SelectionConfig(fraction_evaluate=0.0)),
}
ATTACKS = {"sign_flip": ("sign_flip", -10.0), "noise": ("noise", -10.0),
           "noise1000": ("noise", -1000.0), "inflate": ("inflate", -10.0)}


@functools.cache
def federation(attack_scale: float) -> Any:
    setup = experiments.Setup(num_clients=20, num_attackers=F, partition="iid", seed=0,
                              model="softmax", lr=0.5, batch_size=16,
                              attack_scale=attack_scale)
    return experiments.Federation(setup)


def accuracy(strategy: Any, attack: str, attack_scale: float = -10.0) -> float:
    history = experiments.run_experiment(strategy, federation(attack_scale), attack, ROUNDS)
    return float(experiments.final_accuracy(history))


@functools.cache
def clean_accuracy() -> float:
    return accuracy(FedAvg(selection=SelectionConfig(fraction_evaluate=0.0)), "none")


def test_the_clean_baseline_learns() -> None:
    assert clean_accuracy() > 0.85  # softmax regression on digits: about 0.92


@pytest.mark.parametrize("column", list(ATTACKS))
def test_robust_strategies_hold_while_fedavg_falls(column: str) -> None:
    attack, scale = ATTACKS[column]
    clean = clean_accuracy()
    ratios = {name: accuracy(make(), attack, scale) / clean for name, make in ROBUST.items()}
    fedavg = accuracy(FedAvg(selection=SelectionConfig(fraction_evaluate=0.0)), attack,
                      scale) / clean
    held = {name: r for name, r in ratios.items() if r < 0.9}
    assert not held, f"{column}: below 90% of FedAvg's clean accuracy: {held}"
    if column != "noise":
        assert fedavg <= 0.5, f"{column}: FedAvg kept {fedavg:.0%} of its clean accuracy"


def test_the_attackers_are_the_last_four_and_inflate_their_weight() -> None:
    fed = federation(-10.0)
    make = fed.client_factory("inflate")
    weights = fed.initial_weights()
    honest = make(0).fit(weights, {"seed": 1})
    evil = make(19).fit(weights, {"seed": 1})
    assert list(fed.setup.attackers) == [16, 17, 18, 19]
    assert evil.num_examples == 100 * len(fed.job.clients[19].y)
    assert honest.num_examples == len(fed.job.clients[0].y)
