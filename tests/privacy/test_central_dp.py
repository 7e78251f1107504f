"""`CentralDPStrategy` (DP-FedAvg) against numpy references, statistics and dp-accounting.

References are written here from the papers: McMahan et al. (ICLR 2018) for the clipped,
noised mean over the number sampled; Andrew et al. (NeurIPS 2021) for adaptive clipping
and the noise split; each ε is dp-accounting's on events built in `test_accountant`.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from test_accountant import DELTA, reference_epsilon

from fedloom import ClientInfo, ClientUpdate, ConfigError, ServerConfig, StrategyConfig, Weights
from fedloom.config import SelectionConfig
from fedloom.errors import PrivacyBudgetExhausted
from fedloom.privacy import PrivacyConfig, RoundEvent
from fedloom.secagg import SecAggConfig
from fedloom.strategies import (
    STRATEGIES,
    CentralDPStrategy,
    ComposedStrategy,
    FedAdam,
    FedAvg,
    FedAvgM,
    apply_privacy,
    build_strategy,
)
from fedloom.strategies._dp import DP_MEAN_ID, split_noise
from fedloom.types import AggregateResult

logging.getLogger("absl").setLevel(logging.ERROR)

TINY_Z = 1e-9  # noise std 1e-9 * C: negligible next to float32 rounding


def clients(n: int) -> list[ClientInfo]:
    return [ClientInfo(f"c{i:03d}", f"c{i:03d}") for i in range(n)]


def central(**overrides: Any) -> PrivacyConfig:
    settings: dict[str, Any] = dict(mode="central", noise_multiplier=TINY_Z, clip_norm=1.0,
                                    target_epsilon=0.0)
    settings.update(overrides)
    return PrivacyConfig(**settings)


def dp_strategy(inner: ComposedStrategy | None = None, *, seed: int = 0,
                **privacy: Any) -> CentralDPStrategy:
    inner = inner if inner is not None else FedAvg(selection=SelectionConfig(min_fit_clients=1))
    return CentralDPStrategy(inner, central(**privacy), rng=np.random.default_rng(seed))


def model() -> Weights:
    tensors: dict[str, np.ndarray] = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3),
                                      "b": np.full(5, 0.5, np.float32),
                                      "steps": np.array(7, np.int64)}
    return Weights(tensors)


def delta_of_norm(rng: np.random.Generator, norm: float) -> Weights:
    """A random delta whose float tensors have L2 norm ``norm``; a nonzero integer step."""
    w, b = rng.normal(size=(4, 3)), rng.normal(size=5)
    scale = norm / math.sqrt(float(np.sum(w**2) + np.sum(b**2)))
    tensors: dict[str, np.ndarray] = {"w": (w * scale).astype(np.float32),
                                      "b": (b * scale).astype(np.float32),
                                      "steps": np.array(3, np.int64)}
    return Weights(tensors)


def float_norm(d: Weights) -> float:
    return math.sqrt(sum(float(np.sum(d[k].astype(np.float64) ** 2)) for k in ("w", "b")))


def clipped(d: Weights, clip: float) -> dict[str, np.ndarray]:
    factor = min(1.0, clip / float_norm(d))
    return {k: d[k].astype(np.float64) * factor for k in ("w", "b")}


def run_round(strategy: Any, server_round: int, current: Weights, population: int,
              make_delta: Callable[[str], Weights | None],
              metrics: Callable[[str], dict[str, Any]] | None = None
              ) -> tuple[tuple[str, ...], AggregateResult]:
    """configure_fit, then each chosen client's update (None: it did not return one)."""
    plan = strategy.configure_fit(server_round, current, clients(population))
    updates = []
    for cid in plan.client_ids:
        d = make_delta(cid)
        if d is not None:
            updates.append(ClientUpdate(cid, d, 10, server_round - 1,
                                        metrics(cid) if metrics else {}))
    return plan.client_ids, strategy.aggregate_fit(server_round, current, iter(updates))


# -- clipping and the mean --------------------------------------------------------------------


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


# -- the noise ----------------------------------------------------------------------------------


def gaussian_problems(samples: np.ndarray, std: float) -> list[str]:
    """Why ``samples`` are not N(0, std**2) i.i.d.; empty when they pass.

    With N samples: the mean's standard error is std / sqrt(N), the sample std's relative
    standard error sqrt(1 / (2N)), the share within one std has standard error
    sqrt(p (1 - p) / N) with p = 0.6827 (a uniform of the same std gives 0.577). Each
    threshold is over 5 standard errors, and far below a 10% error in the scale.
    """
    x = samples.astype(np.float64).ravel()
    n, problems = x.size, []
    if abs(x.mean()) > 5 * std / math.sqrt(n):
        problems.append(f"mean {x.mean():g} is not 0 (std {std:g})")
    ratio = x.std() / std
    if abs(ratio - 1) > 0.03:
        problems.append(f"std is {ratio:.4f} of {std:g}")
    within = float(np.mean(np.abs(x) < std))
    if abs(within - 0.6827) > 0.01:
        problems.append(f"{within:.4f} of the samples within one std, not 0.6827")
    return problems


def test_the_noise_check_rejects_a_scale_off_by_ten_percent() -> None:
    noise = np.random.default_rng(5).normal(0.0, 0.25, 60_000)
    assert gaussian_problems(noise, 0.25) == []
    assert gaussian_problems(noise * 1.1, 0.25)
    assert gaussian_problems(noise * 0.9, 0.25)
    assert gaussian_problems(noise + 0.01, 0.25)  # a bias of 4% of the std
    uniform = np.random.default_rng(5).uniform(-0.25 * math.sqrt(3), 0.25 * math.sqrt(3), 60_000)
    assert gaussian_problems(uniform, 0.25)  # same std, not Gaussian


def _noise_of_one_round(strategy: CentralDPStrategy, population: int) -> np.ndarray:
    """The noise on the mean: every sampled client returns a zero delta."""
    current = Weights({"w": np.zeros(60_000, np.float64)})
    _, result = run_round(strategy, 1, current, population,
                          lambda cid: Weights({"w": np.zeros(60_000, np.float64)}))
    assert result.weights is not None
    return np.asarray(result.weights["w"])


@pytest.mark.parametrize(("z", "clip", "m"), [(1.0, 1.0, 4), (0.6, 2.5, 10), (3.0, 0.1, 1)])
def test_noise_on_the_mean_is_gaussian_with_std_z_c_over_m(z: float, clip: float,
                                                           m: int) -> None:
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=m)), seed=11,
                           noise_multiplier=z,
                           clip_norm=clip)
    noise = _noise_of_one_round(strategy, m)
    assert gaussian_problems(noise, z * clip / m) == []


def test_adaptive_clipping_noises_the_sum_with_the_split_multiplier() -> None:
    z, clip, m, count_std = 1.0, 1.0, 20, 1.0
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=m)), seed=12,
                           noise_multiplier=z,
                           clip_norm=clip, clipping="adaptive", count_noise_std=count_std)
    noise = _noise_of_one_round(strategy, m)
    z_delta = 1 / math.sqrt(z**-2 - (2 * count_std) ** -2)
    assert z_delta > 1.15 * z  # far from z for the check
    assert gaussian_problems(noise, z_delta * clip / m) == []


def test_default_noise_comes_from_a_csprng_seeded_generator() -> None:
    privacy = central(noise_multiplier=1.0)
    a = CentralDPStrategy(FedAvg(selection=SelectionConfig(min_fit_clients=2)), privacy)
    b = CentralDPStrategy(FedAvg(selection=SelectionConfig(min_fit_clients=2)), privacy)
    noise_a, noise_b = _noise_of_one_round(a, 2), _noise_of_one_round(b, 2)
    assert not np.allclose(noise_a, noise_b)
    assert gaussian_problems(noise_a, 0.5) == [] and gaussian_problems(noise_b, 0.5) == []
    # Not a fixed seed either: not the noise of default_rng(0) .. default_rng(9).
    for seed in range(10):
        seeded = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=2)), seed=seed,
                             noise_multiplier=1.0)
        assert not np.allclose(_noise_of_one_round(seeded, 2), noise_a)


# -- adaptive clipping ------------------------------------------------------------------------


def test_adaptive_clip_norm_follows_the_geometric_update_to_the_quantile() -> None:
    """Andrew et al. 2021, Alg. 1: C <- C exp(-eta (b - gamma)), b the share of updates
    within C. Noise negligible: z tiny for the sum, count_noise_std small but above z/2
    (the split needs 2 sigma_b > z)."""
    m, rounds, eta, gamma = 100, 120, 0.2, 0.5
    norms = 2.0 * (np.arange(m) + 0.5) / m  # uniform in [0, 2]: the median is 1
    rng = np.random.default_rng(3)
    directions = {f"c{i:03d}": delta_of_norm(rng, norms[i]) for i in range(m)}
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=m)), clip_norm=0.1,
                           clipping="adaptive", target_quantile=gamma,
                           clip_learning_rate=eta, noise_multiplier=1e-6,
                           count_noise_std=1e-4)
    current, expected_clip = model(), 0.1
    for server_round in range(1, rounds + 1):
        _, result = run_round(strategy, server_round, current, m, directions.__getitem__)
        assert result.weights is not None
        assert result.metrics["clip_norm"] == pytest.approx(expected_clip, rel=1e-4)
        share = float(np.mean(norms <= expected_clip))
        expected_clip *= math.exp(-eta * (share - gamma))
        assert strategy.clip_norm == pytest.approx(expected_clip, rel=1e-4)
    assert abs(strategy.clip_norm - 1.0) < 0.05
    # One event of multiplier z per round, whatever the split.
    state = strategy.accountant.state_dict()
    assert state["events"] == [[[1e-6, m, m, 0.0], rounds]]


def test_adaptive_clipping_counts_the_norm_the_client_reports() -> None:
    """A client clips before sending; its reported norm says whether it had to."""
    m = 10
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=m)), clip_norm=1.0,
                           clipping="adaptive", clip_learning_rate=0.5,
                           noise_multiplier=1e-6, count_noise_std=1e-4)
    d = delta_of_norm(np.random.default_rng(4), 1.0)  # every client sends norm C ...
    run_round(strategy, 1, model(), m, lambda cid: d,
              lambda cid: {"update_norm": 3.0})   # ... after clipping from 3
    # share within C = 0: C grows by exp(0.5 * 0.5)
    assert strategy.clip_norm == pytest.approx(math.exp(0.25), rel=1e-4)


@pytest.mark.parametrize(("z", "sigma_b"), [(1.0, 0.6), (1.0, 5.0), (0.3, 0.2), (2.0, 10.0)])
def test_split_noise_is_andrews_rule(z: float, sigma_b: float) -> None:
    """The delta sum's multiplier z_delta and the count's (2 sigma_b: b - 1/2 moves by 1/2
    when a client is added) compose, as Gaussians do, to z: z**-2 = z_delta**-2 +
    (2 sigma_b)**-2 (Andrew et al. 2021, Thm. 1)."""
    z_delta = split_noise(z, sigma_b)
    assert z_delta**-2 + (2 * sigma_b) ** -2 == pytest.approx(z**-2, rel=1e-12)
    assert z_delta > z


@pytest.mark.parametrize(("z", "sigma_b"), [(1.0, 0.5), (1.0, 0.4), (2.0, 0.0)])
def test_split_noise_refuses_a_count_noise_at_or_below_half_z(z: float, sigma_b: float) -> None:
    with pytest.raises(ConfigError) as info:
        split_noise(z, sigma_b)
    assert info.value.setting == "privacy.count_noise_std"


def test_an_impossible_adaptive_split_is_refused_before_clients_train() -> None:
    """With the default count noise (10 clients / 20 = 0.5) and z = 1, 2 sigma_b = z: no
    split exists. That must be refused in configure_fit, before the round's tasks go
    out, not in aggregate_fit after ten clients trained (the coordinator only handles
    AggregationError there)."""
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=10)),
                           noise_multiplier=1.0,
                           clipping="adaptive")
    with pytest.raises(ConfigError) as info:
        strategy.configure_fit(1, model(), clients(10))
    assert info.value.setting == "privacy.count_noise_std"


# -- the budget -------------------------------------------------------------------------------


def test_the_budget_stops_exactly_before_the_round_that_would_exceed_it() -> None:
    z, m, n = 1.2, 4, 10
    event = RoundEvent(z, m, n)
    # Target between the epsilon of 3 and of 4 rounds (dp-accounting, directly).
    eps3, eps4 = (reference_epsilon([event] * k, "fixed") for k in (3, 4))
    target = (eps3 + eps4) / 2
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(fraction_fit=0.4, min_fit_clients=1)),
                           noise_multiplier=z, target_epsilon=target)
    rng, current, done = np.random.default_rng(6), model(), 0
    epsilons = []
    for server_round in range(1, 10):
        try:
            chosen, result = run_round(strategy, server_round, current, n,
                                       lambda cid: delta_of_norm(rng, 2.0))
        except PrivacyBudgetExhausted as exc:
            assert exc.epsilon == pytest.approx(eps3, rel=1e-9)
            assert exc.next_epsilon == pytest.approx(eps4, rel=1e-9)
            assert exc.target == target and exc.delta == DELTA
            break
        assert len(chosen) == m and result.weights is not None
        current = result.weights
        epsilons.append(float(result.metrics["privacy_epsilon"]))
        done += 1
    assert done == 3
    assert epsilons[-1] == pytest.approx(eps3, rel=1e-9) and epsilons[-1] <= target
    assert epsilons == sorted(epsilons)
    assert strategy.privacy_spent() == (pytest.approx(eps3, rel=1e-9), DELTA)
    # Refused again, and the refusal spent nothing.
    with pytest.raises(PrivacyBudgetExhausted):
        strategy.configure_fit(5, current, clients(n))
    assert strategy.accountant.num_rounds == 3


class RefusingFedAvg(FedAvg):
    """FedAvg whose aggregation produces no model (as a mean of non-finite updates does)."""

    def aggregate_fit(self, server_round: int, current: Weights,
                      updates: Any) -> AggregateResult:
        list(updates)
        return AggregateResult(None, num_updates=1, reason="refused by the test")


def test_a_round_without_a_model_records_nothing() -> None:
    strategy = dp_strategy(RefusingFedAvg(selection=SelectionConfig(min_fit_clients=3)),
                           noise_multiplier=1.0,
                           clipping="adaptive", count_noise_std=5.0)
    d = delta_of_norm(np.random.default_rng(7), 3.0)
    _, result = run_round(strategy, 1, model(), 3, lambda cid: d)
    assert result.weights is None and result.reason
    assert strategy.accountant.num_rounds == 0 and strategy.privacy_spent()[0] == 0.0
    assert strategy.clip_norm == 1.0  # C moves only when a round is released


def test_a_round_without_updates_records_nothing() -> None:
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=3)),
                           noise_multiplier=1.0)
    _, result = run_round(strategy, 1, model(), 3, lambda cid: None)
    assert result.weights is None and result.num_updates == 0
    assert strategy.accountant.num_rounds == 0 and strategy.privacy_spent()[0] == 0.0
    # The next round is accounted as usual.
    d = delta_of_norm(np.random.default_rng(8), 1.0)
    _, result = run_round(strategy, 2, model(), 3, lambda cid: d)
    assert result.weights is not None and strategy.accountant.num_rounds == 1


# -- Poisson sampling -------------------------------------------------------------------------


def test_poisson_sampling_picks_each_client_with_probability_fraction_fit() -> None:
    n, q, rounds = 200, 0.3, 200
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(fraction_fit=q, min_fit_clients=1,
                                                            seed=9)), sampling="poisson")
    counts, per_client = [], dict.fromkeys((c.client_id for c in clients(n)), 0)
    for server_round in range(1, rounds + 1):
        plan = strategy.configure_fit(server_round, model(), clients(n))
        counts.append(len(plan.client_ids))
        for cid in plan.client_ids:
            per_client[cid] += 1
    total, expected = sum(counts), n * q * rounds
    assert abs(total - expected) < 5 * math.sqrt(n * rounds * q * (1 - q))
    # The cohort size is Binomial(n, q), not fixed: its variance is n q (1 - q)
    # (the sample variance of 200 rounds has a relative standard error of 0.1).
    assert 0.6 < np.var(counts, ddof=1) / (n * q * (1 - q)) < 1.4
    # Every client near q: Binomial(rounds, q) per client, 5 standard errors.
    spread = 5 * math.sqrt(rounds * q * (1 - q))
    assert all(abs(k - rounds * q) < spread for k in per_client.values())


def test_poisson_rounds_divide_by_the_expected_count_and_record_the_rate() -> None:
    n, q, clip = 20, 0.25, 1.0
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(fraction_fit=q, min_fit_clients=1,
                                                            seed=4)),
                           sampling="poisson", clip_norm=clip)
    rng, current = np.random.default_rng(10), model()
    for server_round in (1, 2):
        deltas = {c.client_id: delta_of_norm(rng, 2.0) for c in clients(n)}
        chosen, result = run_round(strategy, server_round, current, n, deltas.__getitem__)
        assert chosen and result.weights is not None
        for k in ("w", "b"):
            total = sum(clipped(deltas[cid], clip)[k] for cid in chosen)
            expected = current[k].astype(np.float64) + total / (q * n)  # not / len(chosen)
            np.testing.assert_allclose(result.weights[k], expected, rtol=1e-6, atol=1e-6)
        current = result.weights
    assert strategy.accountant.state_dict()["events"] == [[[TINY_Z, 0, n, q], 2]]


# -- composition with the server optimizers ---------------------------------------------------


def _twins(name: str) -> tuple[ComposedStrategy, ComposedStrategy]:
    def make() -> ComposedStrategy:
        if name == "fedavg":
            return FedAvg(selection=SelectionConfig(min_fit_clients=3))
        if name == "fedavgm":
            return FedAvgM(server_learning_rate=0.7, server_momentum=0.9,
                           selection=SelectionConfig(min_fit_clients=3))
        return FedAdam(eta=0.05, beta_1=0.9, beta_2=0.99, tau=1e-3,
                       selection=SelectionConfig(min_fit_clients=3))

    return make(), make()


@pytest.mark.parametrize("name", ["fedavg", "fedavgm", "fedadam"])
def test_the_inner_optimizer_steps_on_the_noised_mean(name: str) -> None:
    inner, reference = _twins(name)
    strategy = dp_strategy(inner, clip_norm=0.5)
    rng = np.random.default_rng(11)
    current = expected = model()
    for server_round in (1, 2, 3):
        deltas = {f"c{i:03d}": delta_of_norm(rng, float(rng.uniform(0.1, 2.0)))
                  for i in range(3)}
        _, result = run_round(strategy, server_round, current, 3, deltas.__getitem__)
        assert result.weights is not None
        mean = Weights({"w": sum(clipped(d, 0.5)["w"] for d in deltas.values()) / 3,
                        "b": sum(clipped(d, 0.5)["b"] for d in deltas.values()) / 3,
                        "steps": np.zeros((), np.int64)})
        mean = Weights((k, v.astype(expected[k].dtype)) for k, v in mean.items())
        step = reference.aggregate_fit(server_round, expected,
                                       [ClientUpdate(DP_MEAN_ID, mean, 1, server_round - 1)])
        assert step.weights is not None
        assert result.weights.allclose(step.weights, rtol=1e-5, atol=1e-6)
        current, expected = result.weights, step.weights


DP_NAMES = ("fedavg", "fedavgm", "fedprox", "fedadagrad", "fedadam", "fedyogi")


@pytest.mark.parametrize("name", sorted(set(STRATEGIES) - set(DP_NAMES)))
def test_robust_rules_are_refused(name: str) -> None:
    strategy = build_strategy(StrategyConfig(name), SelectionConfig(min_fit_clients=10,
                                                                    fraction_evaluate=0.0))
    with pytest.raises(ConfigError) as info:
        apply_privacy(strategy, central())
    assert info.value.setting == "strategy.name"
    with pytest.raises(ConfigError):
        CentralDPStrategy(strategy, central())


@pytest.mark.parametrize("name", DP_NAMES)
def test_mean_strategies_are_wrapped(name: str) -> None:
    strategy = build_strategy(StrategyConfig(name), SelectionConfig(min_fit_clients=2,
                                                                    fraction_evaluate=0.0))
    wrapped = apply_privacy(strategy, central())
    assert isinstance(wrapped, CentralDPStrategy) and wrapped.inner is strategy
    assert apply_privacy(wrapped, central()) is wrapped  # not wrapped twice


def test_a_norm_bounded_strategy_is_refused() -> None:
    strategy = build_strategy(StrategyConfig("fedavg", {"max_update_norm": 1.0}),
                              SelectionConfig(fraction_fit=1.0, min_fit_clients=2,
                                              fraction_evaluate=0.0, min_evaluate_clients=0))
    with pytest.raises(ConfigError) as info:
        apply_privacy(strategy, central())
    assert info.value.setting == "strategy.max_update_norm"


def test_privacy_off_leaves_the_strategy_unchanged() -> None:
    strategy = FedAvg()
    assert apply_privacy(strategy, PrivacyConfig()) is strategy
    assert apply_privacy(strategy, PrivacyConfig(mode="off", noise_multiplier=3.0)) is strategy
    with pytest.raises(ConfigError) as info:
        CentralDPStrategy(FedAvg(), PrivacyConfig())
    assert info.value.setting == "privacy.mode"


# -- state --------------------------------------------------------------------------------------


def _rounds(strategy: CentralDPStrategy, rounds: Sequence[int], seed: int = 12) -> Weights:
    rng, current = np.random.default_rng(seed), model()
    for server_round in rounds:
        _, result = run_round(strategy, server_round, current, 5,
                              lambda cid: delta_of_norm(rng, float(rng.uniform(0.2, 3.0))))
        assert result.weights is not None
        current = result.weights
    return current


def _walk(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _walk(v)] + list(value)
    if isinstance(value, list | tuple):
        return [x for v in value for x in _walk(v)]
    return [value]


def test_state_continues_the_ledger_and_the_clip_norm() -> None:
    def make() -> CentralDPStrategy:
        inner = FedAvgM(server_momentum=0.5, selection=SelectionConfig(min_fit_clients=3,
                                                                       fraction_fit=0.6, seed=1))
        return dp_strategy(inner, noise_multiplier=1e-6, clipping="adaptive",
                           count_noise_std=1e-4)

    original = make()
    _rounds(original, (1, 2))
    state = copy.deepcopy(original.state_dict())
    assert original.clip_norm != 1.0  # C moved
    restored = make()
    restored.load_state_dict(state)
    assert restored.clip_norm == original.clip_norm
    assert restored.accountant.state_dict() == original.accountant.state_dict()
    assert restored.privacy_spent() == original.privacy_spent()
    # Round 3 goes the same way on both: same sample, same clip norm, same epsilon.
    a, b = _rounds(original, (3,), seed=13), _rounds(restored, (3,), seed=13)
    assert a.allclose(b, rtol=1e-5, atol=1e-5)
    assert restored.clip_norm == pytest.approx(original.clip_norm, rel=1e-4)  # count noise
    assert restored.privacy_spent() == original.privacy_spent()
    assert restored.accountant.num_rounds == 3


def test_the_noise_generator_is_not_in_the_state() -> None:
    a = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=3, fraction_fit=0.6, seed=1)),
                    seed=100,
                    noise_multiplier=1.0)
    b = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=3, fraction_fit=0.6, seed=1)),
                    seed=200,
                    noise_multiplier=1.0)
    wa, wb = _rounds(a, (1, 2)), _rounds(b, (1, 2))
    assert not wa.allclose(wb, rtol=0, atol=1e-3)  # different noise ...
    state = a.state_dict()
    assert json.dumps(state, sort_keys=True, default=str) == json.dumps(
        b.state_dict(), sort_keys=True, default=str)  # ... same state
    noise_state = a._rng.bit_generator.state["state"]
    values = {repr(v) for v in _walk(state)}
    assert repr(noise_state["state"]) not in values and repr(noise_state["inc"]) not in values


def test_a_state_without_privacy_is_refused() -> None:
    strategy = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=2)))
    with pytest.raises(ConfigError) as info:
        strategy.load_state_dict(FedAvg(selection=SelectionConfig(min_fit_clients=2)).state_dict())
    assert info.value.setting == "privacy"


def test_a_state_of_other_accounting_terms_is_refused() -> None:
    source = dp_strategy(sampling="none")
    _rounds(source, (1,))
    target = dp_strategy(sampling="poisson")
    with pytest.raises(ConfigError):
        target.load_state_dict(copy.deepcopy(source.state_dict()))


# -- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(("settings", "setting"), [
    ({"mode": "on"}, "mode"),
    ({"clipping": "auto"}, "clipping"),
    ({"sampling": "uniform"}, "sampling"),
    ({"accountant": "moments"}, "accountant"),
    ({"noise_multiplier": 0.0}, "noise_multiplier"),
    ({"noise_multiplier": -1.0}, "noise_multiplier"),
    ({"noise_multiplier": float("nan")}, "noise_multiplier"),
    ({"noise_multiplier": float("inf")}, "noise_multiplier"),
    ({"clip_norm": 0.0}, "clip_norm"),
    ({"clip_norm": float("inf")}, "clip_norm"),
    ({"clip_learning_rate": 0.0}, "clip_learning_rate"),
    ({"target_quantile": 0.0}, "target_quantile"),
    ({"target_quantile": 1.0}, "target_quantile"),
    ({"count_noise_std": -0.1}, "count_noise_std"),
    ({"count_noise_std": float("nan")}, "count_noise_std"),
    ({"delta": 0.0}, "delta"),
    ({"delta": 1.0}, "delta"),
    ({"target_epsilon": -1.0}, "target_epsilon"),
    ({"target_epsilon": float("inf")}, "target_epsilon"),
    ({"target_epsilon": float("nan")}, "target_epsilon"),
    ({"expected_dropout": 1.0}, "expected_dropout"),
    ({"expected_dropout": -0.1}, "expected_dropout"),
    ({"accountant": "pld", "sampling": "fixed"}, "accountant"),
    ({"mode": "distributed", "clipping": "adaptive", "sampling": "none"}, "clipping"),
    ({"mode": "distributed", "sampling": "fixed"}, "sampling"),
    ({"mode": "distributed", "sampling": "poisson"}, "sampling"),
])
def test_privacy_config_refusals_name_the_setting(settings: dict[str, Any], setting: str) -> None:
    with pytest.raises(ConfigError) as info:
        PrivacyConfig(**settings)
    assert info.value.setting == f"privacy.{setting}"


def _server(tmp_path: Any, privacy: PrivacyConfig, **overrides: Any) -> ServerConfig:
    settings: dict[str, Any] = dict(insecure=True, min_clients=8, min_fit_clients=8,
                                    state_dir=str(tmp_path), progress=False, privacy=privacy)
    settings.update(overrides)
    return ServerConfig(**settings)


SECURE = SecAggConfig(enabled=True, allow_unauthenticated=True)


def test_server_config_refusals_name_the_setting(tmp_path: Any) -> None:
    with pytest.raises(ConfigError) as info:
        _server(tmp_path, central(), over_selection=1.3)
    assert info.value.setting == "over_selection" and "[privacy]" in info.value.problem
    distributed = PrivacyConfig(mode="distributed", sampling="none")
    with pytest.raises(ConfigError) as info:
        _server(tmp_path, distributed)
    assert info.value.setting == "privacy.mode" and "secure_aggregation" in info.value.problem
    with pytest.raises(ConfigError) as info:
        _server(tmp_path, central(), secure_aggregation=SECURE)
    assert info.value.setting == "privacy.mode"
    # What is allowed: each mode where it can run, and over-selection without privacy.
    _server(tmp_path, central())
    _server(tmp_path, distributed, secure_aggregation=SECURE)
    _server(tmp_path, PrivacyConfig(), over_selection=1.3)
