"""The distributed Skellam mechanism's noise: the clients' shares sum to Sk(μ_total),
dropouts included."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedloom.errors import ConfigError
from fedloom.privacy._skellam import per_client_noise_mu, realised_noise_mu, sample_skellam


def _moments_match(samples: np.ndarray, mu_total: float) -> bool:
    """Whether mean and variance of the samples fit Sk(mu_total): 0 and 2 mu_total.

    Both are checked to 6 standard errors. The sample variance of N draws has
    variance V² (2/(N-1) + κ/N) with κ = 1/(2 mu) the excess kurtosis of Sk(mu)
    (cumulants: κ2 = κ4 = 2 mu). For N = 200k and large mu the relative standard error
    is 0.32%, so the threshold is about 1.9%, well inside a 10% mis-scaling.
    """
    n, v = samples.size, 2.0 * mu_total
    mean, var = float(samples.mean()), float(samples.var(ddof=1))
    se_var = v * math.sqrt(2.0 / (n - 1) + 1.0 / (2.0 * mu_total) / n)
    return abs(mean) <= 6.0 * math.sqrt(v / n) and abs(var - v) <= 6.0 * se_var


@pytest.mark.parametrize("total_mu", [14.0, 5000.0, 3e9])
def test_sum_of_client_noise_has_the_total_variance(total_mu: float) -> None:
    rng = np.random.default_rng(11)
    clients, coords = 20, 200_000
    mu = per_client_noise_mu(total_mu, clients, 0.0)
    total = sum(sample_skellam(mu, coords, rng) for _ in range(clients))
    assert isinstance(total, np.ndarray) and total.dtype == np.int64
    assert _moments_match(total, total_mu)


@pytest.mark.parametrize("factor", [1.1, 1.21, 0.9, 1 / 1.21])
def test_the_moment_check_rejects_noise_off_by_ten_percent(factor: float) -> None:
    # factor 1.1 / 0.9: variance off by 10%; 1.21 and 1/1.21: the std off by 10%.
    rng = np.random.default_rng(12)
    for total_mu in (14.0, 5000.0):
        samples = sum(sample_skellam(total_mu * factor / 20, 200_000, rng) for _ in range(20))
        assert isinstance(samples, np.ndarray)
        assert not _moments_match(samples, total_mu)


def test_survivors_carry_the_total_noise_despite_dropouts() -> None:
    # 25 sampled, 20% expected to drop: each adds total/20, and the 20 survivors'
    # noise sums to Sk(total).
    rng = np.random.default_rng(13)
    mu = per_client_noise_mu(800.0, 25, 0.2)
    assert realised_noise_mu(mu, 20) == pytest.approx(800.0)
    total = sum(sample_skellam(mu, 200_000, rng) for _ in range(20))
    assert isinstance(total, np.ndarray) and _moments_match(total, 800.0)



def test_a_single_expected_client_adds_all_the_noise() -> None:
    assert per_client_noise_mu(50.0, 1, 0.0) == 50.0
    assert per_client_noise_mu(50.0, 1, 0.5) == 100.0
    with pytest.raises(ConfigError, match="expected_clients"):
        per_client_noise_mu(50.0, 0, 0.0)
    for bad in (-1.0, math.inf, math.nan):  # a total the ledger could not account for
        with pytest.raises(ConfigError, match="total_mu"):
            per_client_noise_mu(bad, 10, 0.0)


def test_no_noisy_clients_realise_no_noise() -> None:
    assert realised_noise_mu(50.0, 0) == 0.0
    with pytest.raises(ValueError, match=">= 0"):
        realised_noise_mu(50.0, -1)

def test_zero_noise_is_zero() -> None:
    np.testing.assert_array_equal(sample_skellam(0.0, 7, np.random.default_rng(0)), 0)
    with pytest.raises(ValueError):
        sample_skellam(-1.0, 7, np.random.default_rng(0))
