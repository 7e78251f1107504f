"""The update-norm bound against a numpy reference, alone and wrapped around strategies."""

from __future__ import annotations

from typing import Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from property_budget import examples

from fedloom import ClientInfo, ClientUpdate, ConfigError, StrategyConfig, Weights
from fedloom.config import SelectionConfig
from fedloom.strategies import (
    FedAvg,
    FedMedian,
    NormBoundedStrategy,
    build_strategy,
    clip_update,
    update_norm,
)


def delta(rng: np.random.Generator, scale: float) -> Weights:
    tensors: dict[str, np.ndarray] = {
        "a": (scale * rng.normal(size=(4, 3))).astype(np.float32),
        "b": (scale * rng.normal(size=5)).astype(np.float32),
        "steps": np.array(int(rng.integers(1, 9)), np.int64)}
    return Weights(tensors)


def reference_norm(d: Weights) -> float:
    """L2 norm over the float tensors, from a float64 concatenation."""
    flat = np.concatenate([d[k].astype(np.float64).ravel() for k in ("a", "b")])
    return float(np.sqrt(np.sum(flat**2)))


@settings(max_examples=examples(30), deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scale=st.floats(0.01, 10.0), bound=st.floats(0.1, 20.0))
def test_clip_update_matches_numpy(seed: int, scale: float, bound: float) -> None:
    d = delta(np.random.default_rng(seed), scale)
    norm = reference_norm(d)
    assert update_norm(d) == pytest.approx(norm, rel=1e-12)
    clipped = clip_update(d, bound)
    factor = min(1.0, bound / norm)
    for k in ("a", "b"):
        np.testing.assert_allclose(clipped[k], d[k].astype(np.float64) * factor, rtol=1e-6)
        assert clipped[k].dtype == np.float32
    assert clipped["steps"] == d["steps"]  # integer buffers are not scaled
    assert reference_norm(clipped) <= bound * (1 + 1e-6)
    if norm <= bound:
        assert clipped is d


def test_clip_update_rejects_bad_bounds() -> None:
    d = delta(np.random.default_rng(0), 1.0)
    for bad in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ConfigError, match="max_update_norm"):
            clip_update(d, bad)


def _round(n: int, seed: int = 0) -> tuple[Weights, list[ClientUpdate], list[float]]:
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {"a": np.zeros((4, 3), np.float32),
                                       "b": np.zeros(5, np.float32),
                                       "steps": np.array(10, np.int64)}
    current = Weights(tensors)
    scales = [0.1, 5.0, 0.2, 8.0, 0.3][:n]
    ups = [ClientUpdate(f"c{i}", delta(rng, s), int(rng.integers(1, 50)), 0)
           for i, s in enumerate(scales)]
    return current, ups, [reference_norm(u.delta) for u in ups]


@pytest.mark.parametrize("mode", ["clip", "reject"])
def test_wrapped_fedavg_matches_reference(mode: Literal["clip", "reject"]) -> None:
    current, ups, norms = _round(5)
    bound = 2.0
    assert sum(n > bound for n in norms) == 2
    strategy = NormBoundedStrategy(FedAvg(), bound, mode)
    result = strategy.aggregate_fit(1, current, iter(ups))
    assert result.weights is not None
    kept = [(u, n) for u, n in zip(ups, norms, strict=True) if mode == "clip" or n <= bound]
    weights = np.array([u.num_examples for u, _ in kept], np.float64)
    for k in ("a", "b"):
        rows = np.stack([u.delta[k].astype(np.float64) * min(1.0, bound / n) for u, n in kept])
        expected = np.tensordot(weights / weights.sum(), rows, axes=1)
        np.testing.assert_allclose(result.weights[k], expected, rtol=1e-5, atol=1e-7)
    expected_steps = np.rint(sum(w * int(u.delta["steps"]) for (u, _), w in
                                 zip(kept, weights, strict=True)) / weights.sum())
    assert result.weights["steps"] == 10 + expected_steps
    assert result.metrics["num_clipped"] == (2 if mode == "clip" else 0)
    assert result.metrics["num_rejected"] == (2 if mode == "reject" else 0)
    assert result.metrics["num_updates"] == (5 if mode == "clip" else 3)


def test_wraps_robust_strategies_too() -> None:
    current, ups, norms = _round(5)
    result = NormBoundedStrategy(FedMedian(), 1.0, "clip").aggregate_fit(1, current, ups)
    assert result.weights is not None
    rows = np.stack([u.delta["a"].astype(np.float64) * min(1.0, 1.0 / n)
                     for u, n in zip(ups, norms, strict=True)])
    np.testing.assert_allclose(result.weights["a"], np.median(rows, axis=0), rtol=1e-6)


def test_all_rejected_gives_no_model_with_reason() -> None:
    current, ups, _ = _round(5)
    result = NormBoundedStrategy(FedAvg(), 1e-6, "reject").aggregate_fit(1, current, ups)
    assert result.weights is None and result.reason
    assert result.metrics["num_rejected"] == 5


def test_bound_is_sent_to_clients_and_state_delegates() -> None:
    inner = FedAvg(selection=SelectionConfig(fraction_fit=0.5, seed=4))
    strategy = NormBoundedStrategy(inner, 3.0, "reject")
    clients = [ClientInfo(f"id{i}") for i in range(6)]
    plan = strategy.configure_fit(2, Weights(), clients)
    assert plan.config["max_update_norm"] == 3.0
    assert plan.config["norm_bound_mode"] == "reject"
    assert plan.config["server_round"] == 2
    assert strategy.state_dict() == inner.state_dict()


def test_registry_wraps_any_strategy() -> None:
    for name in ("fedavg", "fedadam", "krum"):
        built = build_strategy(StrategyConfig(name, {"max_update_norm": 5, "norm_bound_mode":
                                                     "clip"}))
        assert isinstance(built, NormBoundedStrategy) and built.max_update_norm == 5.0
    assert not isinstance(build_strategy(StrategyConfig("fedavg")), NormBoundedStrategy)
    with pytest.raises(ConfigError, match=r"strategy\.max_update_norm"):
        build_strategy(StrategyConfig("fedavg", {"max_update_norm": -1.0}))
    with pytest.raises(ConfigError, match=r"strategy\.norm_bound_mode"):
        build_strategy(StrategyConfig("fedavg", {"max_update_norm": 1.0,
                                                 "norm_bound_mode": "scale"}))


def test_aborted_stream_through_the_wrapper_leaves_state_unchanged() -> None:
    from fedloom import RoundAbortedError
    from fedloom.strategies import FedAdam

    current, ups, _ = _round(5)
    strategy = NormBoundedStrategy(FedAdam(), 1.0, "clip")
    strategy.aggregate_fit(1, current, ups)
    before = strategy.state_dict()

    def stream():  # type: ignore[no-untyped-def]
        yield ups[1]  # clipped on the way through
        raise RoundAbortedError("deadline")

    with pytest.raises(RoundAbortedError):
        strategy.aggregate_fit(2, current, stream())
    after = strategy.state_dict()
    assert after["optimizer"]["steps"] == before["optimizer"]["steps"] == 1
    for key in ("m", "v"):
        for name, arr in before["optimizer"][key].items():
            assert np.array_equal(after["optimizer"][key][name], arr)
