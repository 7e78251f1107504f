"""`CentralDPStrategy` clips each update to C and divides the sum by the number sampled
(McMahan et al., ICLR 2018), against numpy references."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from central_dp_support import (
    TINY_Z,
    clients,
    clipped,
    delta_of_norm,
    dp_strategy,
    float_norm,
    model,
    run_round,
)

from fedloom import Weights
from fedloom.config import SelectionConfig
from fedloom.strategies import FedAvg


def test_each_update_is_clipped_and_the_mean_divides_by_the_number_sampled() -> None:
    rng, clip = np.random.default_rng(1), 0.8
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=4)), clip_norm=clip)
    current = model()
    deltas = {"c000": delta_of_norm(rng, 5.0),   # above C: clipped to C
              "c001": delta_of_norm(rng, 0.3),   # within C: unchanged
              "c002": delta_of_norm(rng, 9.0),   # lies: says it clipped, sends 9
              "c003": None}                      # sampled, never returns
    chosen, result = run_round(
        strategy, 1, current, 4, deltas.__getitem__,
        lambda cid: {"update_norm": 0.1} if cid == "c002" else {})
    assert chosen == ("c000", "c001", "c002", "c003")
    # The fit config tells clients to clip to C.
    assert result.weights is not None
    total = {k: sum(clipped(d, clip)[k] for d in deltas.values() if d is not None)
             for k in ("w", "b")}
    for k in ("w", "b"):
        expected = current[k].astype(np.float64) + total[k] / 4  # 4 sampled, 3 returned
        np.testing.assert_allclose(result.weights[k], expected, rtol=1e-6, atol=1e-6)
        assert result.weights[k].dtype == np.float32
    assert result.weights["steps"] == current["steps"]  # integer tensors stay
    assert result.metrics["num_updates"] == 3
    assert result.metrics["noise_std"] == pytest.approx(TINY_Z * clip / 4)


@pytest.mark.parametrize("norm", [0.5, 3.0, 40.0])
@pytest.mark.parametrize("reported", [None, 0.01])  # 0.01: a client lying about its norm
def test_one_update_contributes_at_most_c(norm: float, reported: float | None) -> None:
    rng, clip, sampled = np.random.default_rng(2), 1.5, 3
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=sampled)),
                           clip_norm=clip)
    current = model()
    d = delta_of_norm(rng, norm)
    _, result = run_round(strategy, 1, current, sampled,
                          lambda cid: d if cid == "c000" else None,
                          lambda cid: {} if reported is None else {"update_norm": reported})
    assert result.weights is not None
    moved = Weights({k: (result.weights[k].astype(np.float64) - current[k]) * sampled
                     for k in ("w", "b")})
    assert float_norm(moved) == pytest.approx(min(norm, clip), rel=1e-5)
    # in the direction of the update
    cosine = sum(float(np.sum(moved[k] * d[k])) for k in ("w", "b")) / (
        float_norm(moved) * float_norm(d))
    assert cosine == pytest.approx(1.0, abs=1e-6)


def test_the_fit_config_asks_clients_to_clip_to_c() -> None:
    strategy = dp_strategy(clip_norm=0.7)
    plan = strategy.configure_fit(1, model(), clients(3))
    assert plan.config["max_update_norm"] == 0.7


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_update_counts_as_zero_and_cannot_pass_the_clip_whole(
        bad: float, caplog: pytest.LogCaptureFixture) -> None:
    """A NaN or inf makes the update's norm NaN, and ``min(1, C / nan)`` is 1: unguarded,
    every other value of that update would be summed unclipped (a norm of 35,000 against
    C = 1 here). Such an update counts as a zero update, and the server says so."""
    current = model()

    def delta(cid: str) -> Weights:
        w = np.full((4, 3), 1e4, np.float32)
        b = np.zeros(5, np.float32)
        if cid == "c000":
            b[0] = bad
        return Weights({"w": w, "b": b, "steps": np.array(3, np.int64)})

    with caplog.at_level(logging.WARNING):
        chosen, result = run_round(dp_strategy(clip_norm=1.0), 1, current, 2, delta)
    assert len(chosen) == 2 and result.weights is not None
    assert result.num_updates == 2
    moved = {k: result.weights[k].astype(np.float64) - current[k] for k in ("w", "b")}
    assert all(np.isfinite(v).all() for v in moved.values())
    norm = math.sqrt(sum(float(np.sum(v**2)) for v in moved.values()))
    assert norm == pytest.approx(1.0 / 2, rel=1e-3)  # the other client's C, over m = 2
    assert any("non-finite update" in r.getMessage() for r in caplog.records)
