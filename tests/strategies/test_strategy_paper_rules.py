"""Where we follow the papers rather than Flower: numpy references written from the
papers' definitions, the preconditions and their messages, and the fit configs."""

from __future__ import annotations

import itertools
from typing import Literal

import numpy as np
import pytest

from fedloom import AggregationError, ClientInfo, ClientUpdate, Weights
from fedloom.strategies import (
    STRATEGIES,
    Bulyan,
    ComposedStrategy,
    FedAdagrad,
    FedAdam,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedYogi,
    Krum,
    MultiKrum,
)


def round_of(n: int, seed: int = 0, dim: int = 6) -> tuple[Weights, list[ClientUpdate]]:
    rng = np.random.default_rng(seed)
    current = Weights({"x": rng.normal(size=dim).astype(np.float32),
                       "y": rng.normal(size=(2, 2)).astype(np.float32)})
    ups = [ClientUpdate(f"c{i}", Weights({"x": rng.normal(size=dim).astype(np.float32),
                                          "y": rng.normal(size=(2, 2)).astype(np.float32)}),
                        int(rng.integers(1, 100)), 0) for i in range(n)]
    return current, ups


def flat(d: Weights) -> np.ndarray:
    return np.concatenate([d[k].astype(np.float64).ravel() for k in d])


def krum_reference(vectors: list[np.ndarray], f: int) -> np.ndarray:
    """Blanchard et al.: score(i) = sum of squared distances to its n - f - 2 closest."""
    n = len(vectors)
    scores = []
    for i in range(n):
        d = sorted(float(np.sum((vectors[i] - vectors[j]) ** 2)) for j in range(n) if j != i)
        scores.append(sum(d[: max(1, n - f - 2)]))
    return np.array(scores)


def unflat(current: Weights, vector: np.ndarray) -> dict[str, np.ndarray]:
    out, at = {}, 0
    for k, arr in current.items():
        out[k] = (arr.astype(np.float64) + vector[at: at + arr.size].reshape(arr.shape))
        at += arr.size
    return out


def assert_weights(result: Weights | None, expected: dict[str, np.ndarray]) -> None:
    assert result is not None
    for k, v in expected.items():
        np.testing.assert_allclose(result[k], v, rtol=1e-6, atol=1e-6, err_msg=k)


# -- Krum, Multi-Krum, Bulyan (paper mode) --------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_krum_and_multikrum_follow_blanchard(seed: int) -> None:
    current, ups = round_of(9, seed)
    vectors = [flat(u.delta) for u in ups]
    order = np.argsort(krum_reference(vectors, 2), kind="stable")
    assert_weights(Krum(num_malicious_nodes=2).aggregate_fit(1, current, ups).weights,
                   unflat(current, vectors[order[0]]))
    # Multi-Krum: the unweighted mean of the m best (num_examples do not count).
    result = MultiKrum(num_malicious_nodes=2, num_nodes_to_select=4).aggregate_fit(1, current, ups)
    assert_weights(result.weights, unflat(current, np.mean([vectors[i] for i in order[:4]], 0)))


def bulyan_reference(vectors: list[np.ndarray], f: int) -> np.ndarray:
    """El Mhamdi et al.: recursive Krum picks n - 2f; per coordinate, the mean of the
    n - 4f values closest to the median of the picked ones."""
    remaining = list(range(len(vectors)))
    picked: list[int] = []
    while len(picked) < len(vectors) - 2 * f:
        scores = krum_reference([vectors[i] for i in remaining], f)
        best = remaining[int(np.argsort(scores, kind="stable")[0])]
        picked.append(best)
        remaining.remove(best)
    beta = len(picked) - 2 * f
    out = np.empty_like(vectors[0])
    for c in range(len(out)):
        values = [vectors[i][c] for i in picked]
        median = float(np.median(values))
        out[c] = np.mean(sorted(values, key=lambda v: abs(v - median))[:beta])
    return out


@pytest.mark.parametrize(("n", "f"), [(7, 1), (11, 2), (12, 2), (5, 0)])
def test_bulyan_follows_el_mhamdi(n: int, f: int) -> None:
    current, ups = round_of(n, seed=n)
    expected = bulyan_reference([flat(u.delta) for u in ups], f)
    result = Bulyan(num_malicious_nodes=f).aggregate_fit(1, current, ups)
    assert_weights(result.weights, unflat(current, expected))


def test_robust_rules_resist_a_far_outlier_that_inflates_num_examples() -> None:
    current, ups = round_of(9, seed=3)
    evil = ClientUpdate("evil", Weights({k: np.full(v.shape, 1e3, np.float32)
                                         for k, v in ups[0].delta.items()}), 10**6, 0)
    for strategy in (FedMedian(), FedTrimmedAvg(beta=0.2), Krum(num_malicious_nodes=1),
                     MultiKrum(num_malicious_nodes=1, num_nodes_to_select=5),
                     Bulyan(num_malicious_nodes=1)):
        result = strategy.aggregate_fit(1, current, [*ups, evil])
        assert result.weights is not None
        assert np.max(np.abs(result.weights["x"] - current["x"])) < 5, type(strategy).__name__


# -- preconditions --------------------------------------------------------------------

def test_krum_precondition_is_enforced_and_named() -> None:
    current, ups = round_of(6)
    with pytest.raises(AggregationError, match=r"Krum precondition failed: .*n > 2f \+ 2.*"
                                               r"at least 7 with f=2.*got n=6"):
        Krum(num_malicious_nodes=2).aggregate_fit(1, current, ups)
    # Flower's behaviour, on request: no check.
    assert Krum(num_malicious_nodes=2, enforce_preconditions=False).aggregate_fit(
        1, current, ups).weights is not None


def test_multikrum_cannot_select_more_than_it_received() -> None:
    current, ups = round_of(5)
    with pytest.raises(AggregationError, match="num_nodes_to_select=6 exceeds the 5"):
        MultiKrum(num_nodes_to_select=6).aggregate_fit(1, current, ups)


def test_bulyan_precondition_raises_or_reports() -> None:
    current, ups = round_of(6)
    with pytest.raises(AggregationError, match=r"n >= 4f \+ 3.*at least 7 with f=1.*got n=6"):
        Bulyan(num_malicious_nodes=1).aggregate_fit(1, current, ups)
    result = Bulyan(num_malicious_nodes=1, enforce_preconditions=False).aggregate_fit(
        1, current, ups)
    assert result.weights is None and "4f + 3" in result.reason


def test_trimmed_mean_needs_enough_updates_to_trim() -> None:
    current, ups = round_of(4)
    with pytest.raises(AggregationError, match=r"beta=0.2 it needs at least 5 updates"):
        FedTrimmedAvg(beta=0.2).aggregate_fit(1, current, ups)
    untrimmed = FedTrimmedAvg(beta=0.2, enforce_preconditions=False).aggregate_fit(1, current, ups)
    assert untrimmed.weights is not None
    expected = np.mean([u.delta["x"].astype(np.float64) for u in ups], axis=0)
    np.testing.assert_allclose(untrimmed.weights["x"], current["x"] + expected, rtol=1e-6)
    assert FedTrimmedAvg(beta=0.2).aggregate_fit(1, *round_of(5)).weights is not None


def test_a_failed_round_can_be_followed_by_a_good_one() -> None:
    strategy = Krum(num_malicious_nodes=2)
    current, ups = round_of(6)
    with pytest.raises(AggregationError):
        strategy.aggregate_fit(1, current, ups)
    assert strategy.aggregate_fit(2, *round_of(7)).weights is not None


def test_only_the_robust_rules_hold_updates() -> None:
    robust = {"fedmedian", "fedtrimmedavg", "krum", "multikrum", "bulyan"}
    for name, cls in STRATEGIES.items():
        assert cls().aggregator.holds_all_updates == (name in robust), name  # type: ignore[call-arg]


# -- FedOpt: the paper's update, bias corrections, integer tensors ---------------------

def adaptive_reference(kind: str, rounds: list[np.ndarray], x0: np.ndarray, *, eta: float,
                       beta_1: float, beta_2: float, tau: float, correction: str) -> np.ndarray:
    """Reddi et al. Algorithm 2, written out (plus the optional Adam corrections)."""
    m, v, x = np.zeros_like(x0), np.zeros_like(x0), x0.copy()
    for t, delta in enumerate(rounds, start=1):
        m = beta_1 * m + (1 - beta_1) * delta
        if kind == "adagrad":
            v = v + delta**2
        elif kind == "adam":
            v = beta_2 * v + (1 - beta_2) * delta**2
        else:
            v = v - (1 - beta_2) * delta**2 * np.sign(v - delta**2)
        lr = eta
        if correction != "none":
            e = t + 1 if correction == "flower" else t
            lr = eta * np.sqrt(1 - beta_2**e) / (1 - beta_1**e)
        x = x + lr * m / (np.sqrt(v) + tau)
    return x


@pytest.mark.parametrize(("kind", "correction"), [("adam", "none"), ("adam", "adam"),
                                                  ("adam", "flower"), ("adagrad", "none"),
                                                  ("yogi", "none")])
def test_fedopt_follows_reddi(kind: str, correction: Literal["none", "adam", "flower"]) -> None:
    rng = np.random.default_rng(7)
    x0 = rng.normal(size=5)
    current = Weights({"x": x0.astype(np.float64)})
    means = []
    strategy: ComposedStrategy
    if kind == "adam":
        strategy = FedAdam(eta=0.3, beta_1=0.8, beta_2=0.95, tau=0.01, bias_correction=correction)
    elif kind == "adagrad":
        strategy = FedAdagrad(eta=0.3, beta_1=0.8, tau=0.01)
    else:
        strategy = FedYogi(eta=0.3, beta_1=0.8, beta_2=0.95, tau=0.01)
    for r in range(1, 5):
        ups = [ClientUpdate(f"c{i}", Weights({"x": rng.normal(size=5)}), int(n), r - 1)
               for i, n in enumerate(rng.integers(1, 30, size=4))]
        n = np.array([u.num_examples for u in ups], np.float64)
        means.append(np.tensordot(n / n.sum(), np.stack([u.delta["x"] for u in ups]), axes=1))
        new = strategy.aggregate_fit(r, current, ups).weights
        assert new is not None
        current = new
    expected = adaptive_reference(kind, means, x0, eta=0.3, beta_1=0.8, beta_2=0.95, tau=0.01,
                                  correction=correction)
    np.testing.assert_allclose(current["x"], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", [FedAdagrad, FedAdam, FedYogi, FedAvgM])
def test_integer_buffers_take_the_mean_delta(cls) -> None:  # type: ignore[no-untyped-def]
    strategy = cls(server_momentum=0.9) if cls is FedAvgM else cls()
    def model(w: float, steps: int) -> Weights:
        tensors: dict[str, np.ndarray] = {"w": np.full(3, w, np.float32),
                                          "steps": np.array(steps, np.int64)}
        return Weights(tensors)

    current = model(0.0, 10)
    for r in range(1, 3):
        ups = [ClientUpdate("a", model(1.0, 4), 1, r - 1),
               ClientUpdate("b", model(1.0, 5), 3, r - 1)]
        new = strategy.aggregate_fit(r, current, ups).weights
        assert new is not None
        current = new
    # Mean delta 4.75 rounds to 5 each round; no momentum, no adaptive step.
    assert current["steps"] == 20 and current["steps"].dtype == np.int64


# -- configs sent to clients -----------------------------------------------------------

def test_fit_configs_carry_eta_l_and_proximal_mu() -> None:
    clients = [ClientInfo("a"), ClientInfo("b")]
    for strategy, eta_l in ((FedAdagrad(), 0.1), (FedAdam(eta_l=0.05), 0.05),
                            (FedYogi(), 0.0316)):
        config = strategy.configure_fit(3, Weights(), clients).config
        assert config["eta_l"] == eta_l and config["server_round"] == 3
    config = FedProx(proximal_mu=0.5, fit_config={"local_epochs": 2}).configure_fit(
        1, Weights(), clients).config
    assert config == {"local_epochs": 2, "server_round": 1, "proximal_mu": 0.5}


def test_fedprox_counts_clients_that_ignore_mu(caplog: pytest.LogCaptureFixture) -> None:
    current, ups = round_of(4)
    echoes = [{"proximal_mu": 0.5}, {}, {"proximal_mu": 0.1}, {"proximal_mu": 0.5}]
    ups = [ClientUpdate(u.client_id, u.delta, u.num_examples, 0, m)
           for u, m in zip(ups, echoes, strict=True)]
    with caplog.at_level("WARNING", logger="fedloom.strategies._fedprox"):
        result = FedProx(proximal_mu=0.5).aggregate_fit(1, current, ups)
    assert result.metrics["num_ignored_proximal_mu"] == 2
    assert "2 update(s) did not apply proximal_mu=0.5" in caplog.text
    assert "c1, c2" in caplog.text  # the clients are named
    caplog.clear()
    assert FedProx().aggregate_fit(1, current, ups).metrics["num_ignored_proximal_mu"] == 0
    assert not caplog.text


def test_median_of_even_count_is_midpoint() -> None:
    current = Weights({"x": np.zeros(1, np.float32)})
    ups = [ClientUpdate(f"c{i}", Weights({"x": np.array([v], np.float32)}), 1, 0)
           for i, v in enumerate([1.0, 7.0, 3.0, 100.0])]
    # Permutation-invariant.
    for perm in itertools.permutations(ups):
        weights = FedMedian().aggregate_fit(1, current, list(perm)).weights
        assert weights is not None and weights["x"][0] == 5.0
