"""Flower's simulation engine (Ray) and the local engine give the same run.

One Ray start (~10 s), so one test. Tolerance: global weights within 1e-6 absolute and
float metrics within 1e-6 relative. Both engines run the same float32 operations in the
same order (same sampled clients, seeds, one torch thread, aggregation in plan order),
so they agree exactly on this machine; the tolerance leaves room only for a platform
whose kernels differ between the driver and Ray's worker processes.
"""

from __future__ import annotations

import math

import pytest

from fedloom.simulations.runner import run_scenario
from fedloom.simulations.scenario import FlowerSpec, PartitionSpec, Scenario

pytestmark = pytest.mark.flower

TOLERANCE = 1e-6


def test_flower_engine_equals_local_engine() -> None:
    scenario = Scenario(
        name="engines", num_clients=6, clients_per_round=3, rounds=2, seed=7,
        evaluate_clients_per_round=2, progress=False,
        partition=PartitionSpec(name="dirichlet", alpha=1.0),
        flower=FlowerSpec(num_cpus=1.0),
    )
    local = run_scenario(scenario, None)
    flower = run_scenario(scenario.replace(engine="flower"), None)
    assert flower.engine == "flower" and len(flower.rounds) == len(local.rounds) == 3
    assert local.weights is not None and flower.weights is not None
    assert flower.weights.allclose(local.weights, rtol=0, atol=TOLERANCE)
    for ours, theirs in zip(local.rounds, flower.rounds, strict=True):
        keys = set(ours.metrics) - {"seconds"}
        assert keys == set(theirs.metrics) - {"seconds"}
        for key in keys:
            a, b = ours.metrics[key], theirs.metrics[key]
            if isinstance(a, float):
                assert math.isclose(a, float(b), rel_tol=TOLERANCE), (ours.round, key)
            else:
                assert a == b, (ours.round, key)
    assert local.rounds[2].get("num_updates") == 3
    assert local.rounds[2].get("federated_num_examples") is not None
