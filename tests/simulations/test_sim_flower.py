"""Flower's simulation engine (Ray) and the local engine give the same run.

One Ray start (~10 s), so one such test (run again once only if Ray's own start timed
out), and one whose Ray start fails at once.
Tolerance: global weights within 1e-6 absolute and
float metrics within 1e-6 relative. Both engines run the same float32 operations in the
same order (same sampled clients, seeds, one torch thread, aggregation in plan order),
so they agree exactly on this machine; the tolerance leaves room only for a platform
whose kernels differ between the driver and Ray's worker processes.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import ray
from flwr.clientapp import ClientApp

from fedloom import Weights
from fedloom.simulations.compression import UPLOAD_BYTES, CompressionSpec
from fedloom.simulations.flower_engine import run_flower
from fedloom.simulations.runner import run_scenario
from fedloom.simulations.scenario import FlowerSpec, PartitionSpec, Scenario
from fedloom.simulations.speed import SpeedSpec
from fedloom.strategies import FedAvg

pytestmark = pytest.mark.flower

TOLERANCE = 1e-6


@pytest.mark.parametrize("compression", [
    CompressionSpec(), CompressionSpec(upload="q8", download="fp16", quantize_block=64),
], ids=["plain", "q8-up-fp16-down"])
def test_flower_engine_equals_local_engine(compression: CompressionSpec) -> None:
    # Heterogeneous speeds and over-selection (5 tasks, the 3 first kept): both engines
    # time the rounds on the same virtual clock and train the same clients. With
    # codecs, both decode the same broadcast and draw the same stochastic rounding.
    scenario = Scenario(
        name="engines", num_clients=6, clients_per_round=3, rounds=2, seed=7,
        evaluate_clients_per_round=2, progress=False,
        partition=PartitionSpec(name="dirichlet", alpha=1.0),
        flower=FlowerSpec(num_cpus=1.0), over_selection=1.5,
        speed=SpeedSpec(distribution="lognormal", jitter=0.2, straggler_fraction=0.3),
        compression=compression,
    )
    local = run_scenario(scenario, None)
    flower = _run_flower_scenario(scenario.replace(engine="flower"))
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
    assert local.rounds[2].get("virtual_time_s") > local.rounds[1].get("virtual_time_s") > 0
    assert [r.num_cancelled for r in flower.rounds[1:]] == [2, 2]
    assert local.rounds[1].get(UPLOAD_BYTES) == flower.rounds[1].get(UPLOAD_BYTES) > 0


def _run_flower_scenario(scenario: Scenario):  # type: ignore[no-untyped-def]
    """Run it; once more only if Ray's own node start timed out (it waits 30 s for its
    raylet, which a busy CI machine has missed): that is Ray's start, not the engine."""
    try:
        return run_scenario(scenario, None)
    except RuntimeError as exc:
        if not _ray_start_timed_out(exc):
            raise
    return run_scenario(scenario, None)


def _ray_start_timed_out(exc: BaseException | None) -> bool:
    while exc is not None:
        if "timed out during startup" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def test_a_failed_runtime_does_not_leave_the_server_app_waiting() -> None:
    """When Flower's simulation runtime fails (here, once Ray has started, its backend
    refuses the client resources), run_flower raises and the ServerApp thread stops too,
    instead of waiting out the round timeout and keeping the process from exiting; Ray
    is shut down."""
    broken_ray = {"client_resources": {"num_cpus": "one"}}
    with pytest.raises(RuntimeError):
        run_flower(FedAvg(), ClientApp(), Weights({"w": np.zeros(3, np.float32)}),
                   num_clients=2, num_rounds=1, backend_config=broken_ray, timeout_s=600.0)
    deadline = time.monotonic() + 10.0
    while _server_app_threads() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _server_app_threads() == []
    assert not ray.is_initialized()


def _server_app_threads() -> list[str]:
    return [t.name for t in threading.enumerate()
            if t.is_alive() and "server_th_with_start_checks" in t.name]
