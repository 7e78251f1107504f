"""Oracle: our robust strategies equal Flower 1.42's on the same updates, round after round.

Ours aggregate deltas, Flower aggregates client weights (current + delta); the rules
are translation-invariant, so results must agree to float32 rounding. Each example runs
1-3 rounds, each side continuing from its own previous output, with unequal
``num_examples`` and several tensors of different shapes (one 0-d).

Where ours default to the papers, Flower's behaviour is selected by an option and the
oracle runs with it (``enforce_preconditions = false``, MultiKrum
``weighted_by_examples = true``, Bulyan ``selection_rule = "multikrum"``); where the two
coincide (a precondition that holds, Krum's single pick) the defaults are run against
Flower too, and a failed precondition must raise. For Krum-style selection each round
must have a clear gap in Krum score at the selection boundary, so float ties do not
decide: the strategies below draw such rounds directly (`admissible_rounds` redraws a
round's deltas from the example's seed until it has one), so every example is run.
The Bulyan oracle runs f = 0 .. 3, each with client counts from its own n = 4f + 3 on
(and some below, where it must refuse).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from property_budget import examples

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


Admissible = Callable[[Round], bool]
#: Redraws of one round's deltas before `admissible_rounds` gives up (a failed test).
MAX_REDRAWS = 200


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A model and its rounds of deltas, each round admissible."""

    initial: Weights
    rounds: list[Round]
    num_clients: int


def admissible_rounds(seed: int, num_clients: int, shapes: Shapes, num_rounds: int,
                      admissible: Admissible = lambda rnd: True) -> Scenario:
    """Rounds drawn from ``seed``; a round a float tie could decide is drawn again
    (deterministically, from the same generator), so the scenario is always usable."""
    rng = np.random.default_rng(seed)
    initial = initial_weights(rng, shapes)
    rounds = []
    for _ in range(num_rounds):
        for _ in range(MAX_REDRAWS):
            rnd = random_round(rng, shapes, num_clients)
            if admissible(rnd):
                break
        else:
            raise AssertionError(f"no admissible round in {MAX_REDRAWS} draws")
        rounds.append(rnd)
    return Scenario(initial, rounds, num_clients)


@st.composite
def scenarios(draw: st.DrawFn, num_clients: st.SearchStrategy[int],
              admissible: Admissible = lambda rnd: True) -> Scenario:
    return admissible_rounds(draw(st.integers(0, 2**32 - 1)), draw(num_clients),
                             draw(shapes_st), draw(rounds_st), admissible)


def play(ours: Any, theirs: Any, scenario: Scenario, expect_error: bool = False) -> None:
    """Run both on the scenario's rounds and compare each round.

    With ``expect_error`` ours must refuse every round (a failed precondition) while
    Flower aggregates anyway.
    """
    current = scenario.initial
    flower_current = {k: v.copy() for k, v in current.items()}
    for server_round, rnd in enumerate(scenario.rounds, start=1):
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


@settings(max_examples=examples(30), deadline=None)
@given(scenario=scenarios(st.integers(1, 9)))
def test_fedmedian_equals_flower(scenario: Scenario) -> None:
    play(FedMedian(), flower.FedMedian(), scenario)


@settings(max_examples=examples(30), deadline=None)
@given(scenario=scenarios(st.integers(1, 12)), beta=st.sampled_from([0.0, 0.1, 0.2, 0.3, 0.45]),
       paper=st.booleans())
def test_fedtrimmedavg_equals_flower(scenario: Scenario, beta: float, paper: bool) -> None:
    """Flower trims ``int(beta * n)`` at each end; ours too, and by default refuses a
    round where that is 0 although ``beta > 0`` (nothing would be trimmed)."""
    ours = FedTrimmedAvg(beta=beta, enforce_preconditions=paper)
    refused = paper and beta > 0 and int(beta * scenario.num_clients) == 0
    play(ours, flower.FedTrimmedAvg(beta=beta), scenario, expect_error=refused)


def _krum_admissible(f: int, m: int) -> Admissible:
    return lambda rnd: clear_gap(reference_scores(rnd.deltas, f), m)


@st.composite
def krum_cases(draw: st.DrawFn, max_selected: int = 1) -> tuple[int, int, Scenario]:
    """(f, m, scenario): f malicious, m selected, rounds with a clear gap at m.

    With one neighbour in a score (``n - f - 2 <= 1``) the two clients nearest each
    other always tie for the lowest score, so m = 1 then starts at n = f + 4 (a tie is
    no test of either side; the refusal below n = 2f + 3 is tested on its own).
    """
    f = draw(st.integers(0, 3))
    m = draw(st.integers(1, max_selected))
    clients = st.integers(f + 4 if m == 1 else 2, 9)
    return f, m, draw(scenarios(clients, _krum_admissible(f, m)))


@settings(max_examples=examples(30), deadline=None)
@given(case=krum_cases(), paper=st.booleans())
def test_krum_equals_flower(case: tuple[int, int, Scenario], paper: bool) -> None:
    """Unchecked (Flower's behaviour) for any n; by default, equal where n > 2f + 2
    (``n - f - 2`` neighbours either way) and a named refusal below it."""
    f, _, scenario = case
    ours = Krum(num_malicious_nodes=f, enforce_preconditions=paper)
    refused = paper and not scenario.num_clients > 2 * f + 2
    play(ours, flower.Krum(num_malicious_nodes=f), scenario, expect_error=refused)


@settings(max_examples=examples(10), deadline=None)
@given(data=st.data())
def test_krum_refuses_rounds_below_its_precondition(data: st.DataObject) -> None:
    f = data.draw(st.integers(0, 3))
    scenario = data.draw(scenarios(st.integers(2, 2 * f + 2)))
    play(Krum(num_malicious_nodes=f), flower.Krum(num_malicious_nodes=f), scenario,
         expect_error=True)


@settings(max_examples=examples(30), deadline=None)
@given(case=krum_cases(max_selected=9))
def test_multikrum_equals_flower(case: tuple[int, int, Scenario]) -> None:
    f, m, scenario = case
    ours = MultiKrum(num_malicious_nodes=f, num_nodes_to_select=m, weighted_by_examples=True,
                     enforce_preconditions=False)
    theirs = flower.MultiKrum(num_malicious_nodes=f, num_nodes_to_select=m)
    play(ours, theirs, scenario)


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


def _bulyan_admissible(f: int) -> Admissible:
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


def _bulyan_clients(f: int) -> st.SearchStrategy[int]:
    """Mostly n >= 4f + 3 (Bulyan aggregates), sometimes fewer (it must refuse)."""
    floor = 4 * f + 3
    if f == 0:
        return st.integers(floor, floor + 4)
    return st.one_of(st.integers(floor, floor + 4), st.integers(floor - 3, floor - 1))


@pytest.mark.parametrize("f", [0, 1, 2, 3])
def test_bulyan_equals_flower(f: int) -> None:
    """Flower's selection rule (one Multi-Krum pass); below n = 4f + 3 Flower returns
    None, ours yields no model with the reason, or raises by default."""

    @settings(max_examples=examples(20), deadline=None)
    @given(scenario=scenarios(_bulyan_clients(f), _bulyan_admissible(f)), enforce=st.booleans())
    def check(scenario: Scenario, enforce: bool) -> None:
        ours = Bulyan(num_malicious_nodes=f, selection_rule="multikrum",
                      enforce_preconditions=enforce)
        refused = enforce and scenario.num_clients < 4 * f + 3
        play(ours, flower.Bulyan(num_malicious_nodes=f), scenario, expect_error=refused)

    check()
