"""`fedloom simulate`'s engine choice end to end: a scenario's ``[engine]`` picks the
fitter, and every in-process engine gives the local engine's model."""

from __future__ import annotations

import numpy as np

from fedloom.simulations.runner import run_scenario
from fedloom.simulations.scenario import scenario_from_mapping

BASE = {"num_clients": 8, "clients_per_round": 5, "rounds": 2, "seed": 11, "progress": False,
        "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 3}}


def _run(**changes: object):  # type: ignore[no-untyped-def]
    return run_scenario(scenario_from_mapping({**BASE, **changes}), None)


def test_worker_processes_give_the_serial_model_bit_for_bit() -> None:
    serial, parallel = _run(), _run(engine={"name": "local", "workers": 2})
    assert serial.weights is not None and parallel.weights is not None
    for name in serial.weights:
        np.testing.assert_array_equal(parallel.weights[name], serial.weights[name])
    assert parallel.engine == "local"
    assert [r.get("train_loss") for r in parallel.rounds] == [
        r.get("train_loss") for r in serial.rounds]


def test_the_vectorized_engine_gives_the_local_model_within_float_rounding() -> None:
    local, vectorized = _run(), _run(engine={"name": "vectorized", "chunk_size": 3})
    assert local.weights is not None and vectorized.weights is not None
    assert vectorized.engine == "vectorized"
    assert vectorized.weights.allclose(local.weights, rtol=1e-4, atol=1e-5)
    assert not vectorized.weights.allclose(_run(seed=12).weights, rtol=1e-4, atol=1e-5)


def test_the_vectorized_engine_runs_secure_rounds() -> None:
    secure = {"enabled": True, "neighbours": 4, "threshold": 3}
    local = _run(secure_aggregation=secure)
    vectorized = _run(secure_aggregation=secure, engine="vectorized")
    assert local.weights is not None and vectorized.weights is not None
    assert vectorized.weights.allclose(local.weights, rtol=1e-3, atol=1e-4)
    assert vectorized.rounds[-1].get("num_updates") == 5
