"""Adaptive clipping (Andrew et al., NeurIPS 2021): the geometric update of C to the
target quantile and the split of the noise between the sum and the count."""

from __future__ import annotations

import math

import numpy as np
import pytest
from central_dp_support import clients, delta_of_norm, dp_strategy, model, run_round

from fedloom import ConfigError
from fedloom.config import SelectionConfig
from fedloom.strategies import FedAvg
from fedloom.strategies._dp import split_noise


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


def test_a_round_too_small_for_the_adaptive_split_is_not_run_and_the_run_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    """With the default count noise (10 clients / 20 = 0.5) and z = 1, 2 sigma_b = z: no
    split exists for a round of 10. Found in configure_fit, before any task goes out: the
    round is not run (no client trains, nothing is released or spent) and says why; a
    later round with more clients runs. (It raised, which ended a server mid-run, and a
    resumed run may not change its privacy settings.) Said at start too."""
    with caplog.at_level("WARNING"):
        strategy = dp_strategy(FedAvg(selection=SelectionConfig(min_fit_clients=10)),
                               noise_multiplier=1.0, clipping="adaptive")
    assert any("a round of fewer than 11 clients is not run (min_fit_clients is 10)"
               in r.getMessage() for r in caplog.records)
    plan = strategy.configure_fit(1, model(), clients(10))
    assert plan.client_ids == ()
    result = strategy.aggregate_fit(1, model(), [])
    assert result.weights is None and result.reason.startswith(
        "not run: adaptive clipping needs 2 * count_noise_std (1) above the noise multiplier")
    assert strategy.privacy_spent()[0] == 0.0
    assert len(strategy.configure_fit(2, model(), clients(11)).client_ids) == 11


def test_a_count_noise_std_too_small_for_every_round_is_refused_at_start() -> None:
    with pytest.raises(ConfigError) as info:
        dp_strategy(FedAvg(), noise_multiplier=1.0, clipping="adaptive", count_noise_std=0.4)
    assert info.value.setting == "privacy.count_noise_std"
