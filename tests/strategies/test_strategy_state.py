"""Every strategy's state survives a checkpoint mid-run and a round aborted mid-stream.

- save/load: run two rounds, put the state through a checkpoint-like encoding (JSON
  for everything but arrays; arrays stored apart, and 0-d arrays come back 1-d as the
  server's writer stores them), load it into a strategy built with another seed, and
  require both to continue identically (same sampled clients, bit-equal weights);
- abort: when the updates iterable raises midway, the state is unchanged and the next
  round equals that of a twin that never saw the aborted round (the contract's rule).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from fedloom import ClientInfo, ClientUpdate, RoundAbortedError, StrategyConfig, Weights
from fedloom.config import SelectionConfig
from fedloom.strategies import STRATEGIES, build_strategy

# Settings that give each strategy non-trivial state and a valid round with 6 updates.
PARAMS: dict[str, dict[str, Any]] = {
    "fedavgm": {"server_momentum": 0.9, "server_learning_rate": 0.7},
    "fedprox": {"proximal_mu": 0.1},
    "fedadagrad": {"beta_1": 0.5},
    "fedadam": {"bias_correction": "adam"},
    "fedtrimmedavg": {"beta": 0.2},
    "krum": {"num_malicious_nodes": 1},
    "multikrum": {"num_malicious_nodes": 1, "num_nodes_to_select": 3},
    "bulyan": {"num_malicious_nodes": 0},
}
CLIENTS = [ClientInfo(f"id{i}", f"client{i}") for i in range(12)]
SHAPES = {"w": (3, 2), "b": (2,), "s": (), "steps": ()}


def build(name: str, seed: int, fraction_fit: float = 0.5):  # type: ignore[no-untyped-def]
    selection = SelectionConfig(fraction_fit=fraction_fit, min_fit_clients=6, seed=seed)
    return build_strategy(StrategyConfig(name, PARAMS.get(name, {})), selection)


def initial() -> Weights:
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray] = {
        k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items() if k != "steps"}
    tensors["steps"] = np.array(100, np.int64)
    return Weights(tensors)


def updates(server_round: int, client_ids: tuple[str, ...]) -> list[ClientUpdate]:
    rng = np.random.default_rng(1000 + server_round)
    out = []
    for cid in client_ids:
        delta: dict[str, np.ndarray] = {
            k: (0.2 * rng.normal(size=s)).astype(np.float32)
            for k, s in SHAPES.items() if k != "steps"}
        delta["steps"] = np.array(int(rng.integers(1, 5)), np.int64)
        out.append(ClientUpdate(cid, Weights(delta), int(rng.integers(1, 50)), server_round - 1,
                                {"proximal_mu": 0.1}))
    return out


def play(strategy, current: Weights, rounds: range) -> tuple[Weights, list[tuple[str, ...]]]:  # type: ignore[no-untyped-def]
    plans = []
    for r in rounds:
        plan = strategy.configure_fit(r, current, CLIENTS)
        plans.append(plan.client_ids)
        result = strategy.aggregate_fit(r, current, updates(r, plan.client_ids))
        assert result.weights is not None, result.reason
        current = result.weights
    return current, plans


def checkpoint_round_trip(state: Any) -> Any:
    """Encode as the server's checkpoint does: JSON plus arrays kept apart (0-d -> 1-d)."""
    arrays: list[np.ndarray] = []

    def encode(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            arrays.append(np.ascontiguousarray(value).copy())
            return {"__array__": len(arrays) - 1}
        if isinstance(value, dict):
            return {str(k): encode(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [encode(v) for v in value]
        if isinstance(value, np.generic):
            return value.item()
        assert value is None or isinstance(value, bool | int | float | str), type(value)
        return value

    def decode(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {"__array__"}:
                return arrays[value["__array__"]]
            return {k: decode(v) for k, v in value.items()}
        if isinstance(value, list):
            return [decode(v) for v in value]
        return value

    return decode(json.loads(json.dumps(encode(state))))


def same_state(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def assert_bit_equal(a: Weights, b: Weights) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        assert np.array_equal(a[k], b[k]), k


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_save_load_mid_run_continues_identically(name: str) -> None:
    first = build(name, seed=3)
    current, _ = play(first, initial(), range(1, 3))
    state = first.state_dict()
    if name in ("fedavgm", "fedadagrad", "fedadam", "fedyogi"):
        assert any(isinstance(v, dict) for v in state["optimizer"].values()), state["optimizer"]
    resumed = build(name, seed=99)
    resumed.load_state_dict(checkpoint_round_trip(state))
    end_a, plans_a = play(first, current, range(3, 6))
    end_b, plans_b = play(resumed, current, range(3, 6))
    assert plans_a == plans_b
    assert_bit_equal(end_a, end_b)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_without_the_state_a_run_diverges(name: str) -> None:
    """The check above can fail: a fresh strategy (no state loaded) samples differently."""
    first = build(name, seed=3)
    current, _ = play(first, initial(), range(1, 3))
    fresh = build(name, seed=99)
    _, plans_a = play(first, current, range(3, 6))
    _, plans_b = play(fresh, current, range(3, 6))
    assert plans_a != plans_b


@pytest.mark.parametrize("name", ["fedavgm", "fedadagrad", "fedadam", "fedyogi"])
def test_optimizer_state_matters(name: str) -> None:
    """Same sampler, but moments dropped: the next weights differ."""
    first = build(name, seed=3, fraction_fit=1.0)
    current, _ = play(first, initial(), range(1, 3))
    state = first.state_dict()
    resumed = build(name, seed=3, fraction_fit=1.0)
    resumed.load_state_dict({"sampler": state["sampler"], "optimizer": {}})
    end_a, _ = play(first, current, range(3, 4))
    end_b, _ = play(resumed, current, range(3, 4))
    assert not np.array_equal(end_a["w"], end_b["w"])


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_aborted_stream_leaves_state_unchanged(name: str) -> None:
    strategy, twin = build(name, seed=5, fraction_fit=1.0), build(name, seed=5, fraction_fit=1.0)
    current, _ = play(strategy, initial(), range(1, 2))
    play(twin, initial(), range(1, 2))
    before = checkpoint_round_trip(strategy.state_dict())

    def stream() -> Iterator[ClientUpdate]:
        yield from updates(2, tuple(c.client_id for c in CLIENTS))[:3]
        raise RoundAbortedError("deadline passed")

    with pytest.raises(RoundAbortedError):
        strategy.aggregate_fit(2, current, stream())
    assert same_state(checkpoint_round_trip(strategy.state_dict()), before)
    end_a, _ = play(strategy, current, range(2, 4))
    end_b, _ = play(twin, current, range(2, 4))
    assert_bit_equal(end_a, end_b)


def test_loading_a_foreign_state_is_refused() -> None:
    strategy = build("fedadam", seed=0)
    with pytest.raises(ValueError, match="unknown keys"):
        strategy.load_state_dict({"sampler": strategy.state_dict()["sampler"],
                                  "optimizer": {"momentum": None}})
    momentum = build("fedavgm", seed=0)
    with pytest.raises(ValueError, match="mapping"):
        momentum.load_state_dict({"sampler": momentum.state_dict()["sampler"],
                                  "optimizer": {"momentum": [1.0, 2.0]}})


#: Strategies whose step is bounded by its learning rate (Adam-like) cannot overflow here.
BOUNDED_STEPS = {"fedadagrad", "fedadam", "fedyogi"}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_step_that_would_overflow_the_model_produces_none_and_keeps_the_state(
        name: str) -> None:
    # Finite values a client may send (float32's largest are about 3.4e38) sum past the
    # dtype's range: the round produces no model, and the optimizer forgets nothing.
    strategy = build(name, seed=3)
    current, _ = play(strategy, initial(), range(1, 3))
    huge = Weights({k: np.full(v.shape, 3e38, v.dtype) if v.dtype.kind == "f" else v
                    for k, v in current.items()})
    plan = strategy.configure_fit(3, huge, CLIENTS)
    before = checkpoint_round_trip(strategy.state_dict())
    poisoned = [ClientUpdate(u.client_id, Weights(
        {k: np.full(v.shape, 3e38, v.dtype) if v.dtype.kind == "f" else v
         for k, v in u.delta.items()}), u.num_examples, u.base_round, u.metrics)
        for u in updates(3, plan.client_ids)]
    result = strategy.aggregate_fit(3, huge, poisoned)
    if name in BOUNDED_STEPS:
        assert result.weights is not None
        assert all(np.isfinite(a).all() for a in result.weights.values())
        return
    assert result.weights is None
    assert "non-finite" in result.reason and "unchanged" in result.reason, result.reason
    assert same_state(checkpoint_round_trip(strategy.state_dict()), before)
    play(strategy, current, range(4, 6))  # and the run goes on from the model it had


@pytest.mark.parametrize("name", sorted(BOUNDED_STEPS))
def test_a_step_whose_optimizer_state_would_overflow_is_not_taken(name: str) -> None:
    # A float64 model: a finite delta of 1e200 squares past float64's range in the
    # second moment, while the weights stay finite (the step is bounded by eta): the
    # moment would freeze every later step, and no checkpoint holding it would load.
    strategy = build(name, seed=3)
    current = Weights({"w": np.ones((3, 2))})
    plan = strategy.configure_fit(1, current, CLIENTS)
    before = checkpoint_round_trip(strategy.state_dict())
    huge = [ClientUpdate(cid, Weights({"w": np.full((3, 2), 1e200)}), 1, 0, {})
            for cid in plan.client_ids]
    result = strategy.aggregate_fit(1, current, huge)
    assert result.weights is None
    assert "non-finite" in result.reason and "unchanged" in result.reason, result.reason
    assert same_state(checkpoint_round_trip(strategy.state_dict()), before)
    assert all(np.isfinite(np.asarray(v)).all() for v in _arrays(strategy.state_dict()))


def _arrays(state: Any) -> list[np.ndarray]:
    if isinstance(state, np.ndarray):
        return [state]
    if isinstance(state, dict):
        return [a for v in state.values() for a in _arrays(v)]
    if isinstance(state, list | tuple):
        return [a for v in state for a in _arrays(v)]
    return []
