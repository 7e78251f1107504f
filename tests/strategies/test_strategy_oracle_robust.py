"""Oracle: our robust strategies equal Flower 1.42's on the same updates.

Ours aggregate deltas, Flower aggregates client weights (current + delta); the rules
are translation-invariant, so results must agree to float32 rounding. The Flower
behaviours are selected where ours default to the paper's (``enforce_preconditions =
false``, MultiKrum ``weighted_by_examples = true``, Bulyan ``selection_rule =
"multikrum"``). For Krum-style selection the inputs are required (``assume``) to have a
clear gap in Krum score at the selection boundary, so float ties do not decide.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

pytest.importorskip("flwr")

from flower_oracle import (
    SHAPES,
    assert_close,
    client_weights,
    initial_weights,
    random_round,
    replies,
    setup_flower,
    to_dict,
)

from fedloom import Weights
from fedloom.strategies import Bulyan, FedMedian, FedTrimmedAvg, Krum, MultiKrum

setup_flower()

from flwr.serverapp import strategy as flower  # noqa: E402

RTOL = ATOL = 1e-5
shapes_st = st.lists(st.sampled_from(SHAPES), min_size=2, max_size=4, unique=True)


def reference_scores(deltas: list[Weights], f: int) -> np.ndarray:
    """Krum scores from explicit differences in float64 (independent of both sides)."""
    flat = np.stack([np.concatenate([d[k].astype(np.float64).ravel() for k in d])
                     for d in deltas])
    n = len(flat)
    dist = ((flat[:, None, :] - flat[None, :, :]) ** 2).sum(axis=2)
    k = min(max(1, n - f - 2), n - 1)
    return np.array([np.sort(np.delete(dist[i], i))[:k].sum() for i in range(n)])


def clear_gap(scores: np.ndarray, m: int) -> bool:
    """The m-th and (m+1)-th lowest scores differ by more than 0.1% (or m takes all)."""
    if m >= len(scores):
        return True
    s = np.sort(scores)
    return bool(s[m] - s[m - 1] > 1e-3 * max(s[m], 1e-12))


def run_one(ours, theirs, seed: int, num_clients: int, shapes):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    current = initial_weights(rng, shapes)
    rnd = random_round(rng, shapes, num_clients)
    record, _ = theirs.aggregate_train(
        1, replies(client_weights(dict(current), rnd), rnd.num_examples))
    result = ours.aggregate_fit(1, current, rnd.updates(0))
    return rnd, record, result


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_clients=st.integers(1, 9), shapes=shapes_st)
def test_fedmedian_equals_flower(seed: int, num_clients: int, shapes) -> None:
    _, record, result = run_one(FedMedian(), flower.FedMedian(), seed, num_clients, shapes)
    assert_close(result.weights, to_dict(record), RTOL, ATOL)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_clients=st.integers(1, 12), shapes=shapes_st,
       beta=st.sampled_from([0.0, 0.1, 0.2, 0.3, 0.45]))
def test_fedtrimmedavg_equals_flower(seed: int, num_clients: int, shapes, beta: float) -> None:
    ours = FedTrimmedAvg(beta=beta, enforce_preconditions=False)
    _, record, result = run_one(ours, flower.FedTrimmedAvg(beta=beta), seed, num_clients, shapes)
    assert_close(result.weights, to_dict(record), RTOL, ATOL)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_clients=st.integers(2, 9), shapes=shapes_st,
       f=st.integers(0, 3))
def test_krum_equals_flower_unchecked(seed: int, num_clients: int, shapes, f: int) -> None:
    rng = np.random.default_rng(seed)
    initial_weights(rng, shapes)
    assume(clear_gap(reference_scores(random_round(rng, shapes, num_clients).deltas, f), 1))
    ours = Krum(num_malicious_nodes=f, enforce_preconditions=False)
    _, record, result = run_one(ours, flower.Krum(num_malicious_nodes=f), seed, num_clients,
                                shapes)
    assert_close(result.weights, to_dict(record), RTOL, ATOL)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_clients=st.integers(2, 9), shapes=shapes_st,
       f=st.integers(0, 3), m=st.integers(1, 9))
def test_multikrum_equals_flower(seed: int, num_clients: int, shapes, f: int, m: int) -> None:
    rng = np.random.default_rng(seed)
    initial_weights(rng, shapes)
    assume(clear_gap(reference_scores(random_round(rng, shapes, num_clients).deltas, f), m))
    ours = MultiKrum(num_malicious_nodes=f, num_nodes_to_select=m, weighted_by_examples=True,
                     enforce_preconditions=False)
    theirs = flower.MultiKrum(num_malicious_nodes=f, num_nodes_to_select=m)
    _, record, result = run_one(ours, theirs, seed, num_clients, shapes)
    assert_close(result.weights, to_dict(record), RTOL, ATOL)


def _median_gap_ok(deltas: list[Weights], chosen: list[int], beta: int) -> bool:
    """Per coordinate, the beta-th and (beta+1)-th distances to the median differ clearly."""
    if beta >= len(chosen):
        return True
    for k in deltas[0]:
        values = np.stack([deltas[i][k].astype(np.float64).ravel() for i in chosen])
        dist = np.sort(np.abs(values - np.median(values, axis=0)), axis=0)
        if np.any(dist[beta] - dist[beta - 1] < 1e-5):
            return False
    return True


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_clients=st.integers(3, 12), shapes=shapes_st,
       f=st.integers(0, 2))
def test_bulyan_equals_flower(seed: int, num_clients: int, shapes, f: int) -> None:
    rng = np.random.default_rng(seed)
    initial_weights(rng, shapes)
    deltas = random_round(rng, shapes, num_clients).deltas
    n = num_clients
    if n >= 4 * f + 3:
        theta = n - 2 * f
        scores = reference_scores(deltas, f)
        assume(clear_gap(scores, theta))
        chosen = [int(i) for i in np.argsort(scores, kind="stable")[:theta]]
        assume(_median_gap_ok(deltas, chosen, theta - 2 * f))
    ours = Bulyan(num_malicious_nodes=f, selection_rule="multikrum", enforce_preconditions=False)
    _, record, result = run_one(ours, flower.Bulyan(num_malicious_nodes=f), seed, n, shapes)
    if n < 4 * f + 3:  # Flower returns None; ours: no model, with the reason
        assert record is None
        assert result.weights is None and "4f + 3" in result.reason
        return
    assert_close(result.weights, to_dict(record), RTOL, ATOL)
