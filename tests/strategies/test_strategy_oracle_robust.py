"""Oracle: our robust strategies equal Flower 1.42's on the same updates, round after round.

Ours aggregate deltas, Flower aggregates client weights (current + delta); the rules
are translation-invariant, so results must agree to float32 rounding. Each example runs
1-3 rounds, each side continuing from its own previous output, with unequal
``num_examples`` and several tensors of different shapes (one 0-d).

Where ours default to the papers, Flower's behaviour is selected by an option and the
oracle runs with it (``enforce_preconditions = false``, MultiKrum
``weighted_by_examples = true``, Bulyan ``selection_rule = "multikrum"``); where the two
coincide (a precondition that holds, Krum's single pick) the defaults are run against
Flower too, and a failed precondition must raise. For Krum-style selection the inputs
are required (``assume``) to have a clear gap in Krum score at the selection boundary,
so float ties do not decide.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

pytest.importorskip("flwr")

from flower_oracle import (
    SHAPES,
    Round,
    assert_close,
    client_weights,
    initial_weights,
    random_round,
    replies,
    setup_flower,
    to_dict,
)

from fedloom import AggregationError, Weights
from fedloom.strategies import Bulyan, FedMedian, FedTrimmedAvg, Krum, MultiKrum

setup_flower()

from flwr.serverapp import strategy as flower  # noqa: E402

RTOL = ATOL = 1e-5
Shapes = list[tuple[int, ...]]
shapes_st = st.lists(st.sampled_from(SHAPES), min_size=2, max_size=4, unique=True)
rounds_st = st.integers(1, 3)


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


def play(
    ours: Any, theirs: Any, seed: int, num_clients: int, shapes: Shapes,
    num_rounds: int, admissible: Callable[[Round], bool] = lambda rnd: True,
    expect_error: bool = False,
) -> None:
    """Run both for ``num_rounds`` rounds on the same random deltas and compare each round.

    ``admissible`` rejects (hypothesis ``assume``) rounds whose outcome a float tie could
    decide; with ``expect_error`` ours must refuse every round (a failed precondition)
    while Flower aggregates anyway.
    """
    rng = np.random.default_rng(seed)
    current = initial_weights(rng, shapes)
    flower_current = {k: v.copy() for k, v in current.items()}
    for server_round in range(1, num_rounds + 1):
        rnd = random_round(rng, shapes, num_clients)
        assume(admissible(rnd))
        record, _ = theirs.aggregate_train(
            server_round, replies(client_weights(flower_current, rnd), rnd.num_examples))
        if expect_error:
            with pytest.raises(AggregationError, match="precondition failed"):
                ours.aggregate_fit(server_round, current, rnd.updates(server_round - 1))
            return
        result = ours.aggregate_fit(server_round, current, rnd.updates(server_round - 1))
        if record is None:  # Flower's silent (None, None); ours: no model, with the reason
            assert result.weights is None and result.reason
            return
        flower_next = to_dict(record)
        assert_close(result.weights, flower_next, RTOL, ATOL)
        current, flower_current = result.weights, flower_next


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_clients=st.integers(1, 9), shapes=shapes_st,
       num_rounds=rounds_st)
def test_fedmedian_equals_flower(seed: int, num_clients: int, shapes: Shapes,
                                 num_rounds: int) -> None:
    play(FedMedian(), flower.FedMedian(), seed, num_clients, shapes, num_rounds)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_clients=st.integers(1, 12), shapes=shapes_st,
       beta=st.sampled_from([0.0, 0.1, 0.2, 0.3, 0.45]), num_rounds=rounds_st,
       paper=st.booleans())
def test_fedtrimmedavg_equals_flower(seed: int, num_clients: int, shapes: Shapes, beta: float,
                                     num_rounds: int, paper: bool) -> None:
    """Flower trims ``int(beta * n)`` at each end; ours too, and by default refuses a
    round where that is 0 although ``beta > 0`` (nothing would be trimmed)."""
    ours = FedTrimmedAvg(beta=beta, enforce_preconditions=paper)
    refused = paper and beta > 0 and int(beta * num_clients) == 0
    play(ours, flower.FedTrimmedAvg(beta=beta), seed, num_clients, shapes, num_rounds,
         expect_error=refused)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_clients=st.integers(2, 9), shapes=shapes_st,
       f=st.integers(0, 3), num_rounds=rounds_st, paper=st.booleans())
def test_krum_equals_flower(seed: int, num_clients: int, shapes: Shapes, f: int, num_rounds: int,
                            paper: bool) -> None:
    """Unchecked (Flower's behaviour) for any n; by default, equal where n > 2f + 2
    (``n - f - 2`` neighbours either way) and a named refusal below it."""
    ours = Krum(num_malicious_nodes=f, enforce_preconditions=paper)
    refused = paper and not num_clients > 2 * f + 2
    play(ours, flower.Krum(num_malicious_nodes=f), seed, num_clients, shapes, num_rounds,
         admissible=lambda rnd: clear_gap(reference_scores(rnd.deltas, f), 1),
         expect_error=refused)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_clients=st.integers(2, 9), shapes=shapes_st,
       f=st.integers(0, 3), m=st.integers(1, 9), num_rounds=rounds_st)
def test_multikrum_equals_flower(seed: int, num_clients: int, shapes: Shapes, f: int, m: int,
                                 num_rounds: int) -> None:
    ours = MultiKrum(num_malicious_nodes=f, num_nodes_to_select=m, weighted_by_examples=True,
                     enforce_preconditions=False)
    theirs = flower.MultiKrum(num_malicious_nodes=f, num_nodes_to_select=m)
    play(ours, theirs, seed, num_clients, shapes, num_rounds,
         admissible=lambda rnd: clear_gap(reference_scores(rnd.deltas, f), m))


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


def _bulyan_admissible(f: int) -> Callable[[Round], bool]:
    def admissible(rnd: Round) -> bool:
        n = len(rnd.deltas)
        if n < 4 * f + 3:
            return True
        theta = n - 2 * f
        scores = reference_scores(rnd.deltas, f)
        if not clear_gap(scores, theta):
            return False
        chosen = [int(i) for i in np.argsort(scores, kind="stable")[:theta]]
        return _median_gap_ok(rnd.deltas, chosen, theta - 2 * f)

    return admissible


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_clients=st.integers(3, 12), shapes=shapes_st,
       f=st.integers(0, 2), num_rounds=rounds_st, enforce=st.booleans())
def test_bulyan_equals_flower(seed: int, num_clients: int, shapes: Shapes, f: int, num_rounds: int,
                              enforce: bool) -> None:
    """Flower's selection rule (one Multi-Krum pass); below n = 4f + 3 Flower returns
    None, ours yields no model with the reason, or raises by default."""
    ours = Bulyan(num_malicious_nodes=f, selection_rule="multikrum",
                  enforce_preconditions=enforce)
    refused = enforce and num_clients < 4 * f + 3
    play(ours, flower.Bulyan(num_malicious_nodes=f), seed, num_clients, shapes, num_rounds,
         admissible=_bulyan_admissible(f), expect_error=refused)
