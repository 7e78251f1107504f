"""The distributed Skellam mechanism's privacy accounting: its RDP against
dp-accounting's Gaussian, composition and ε."""

from __future__ import annotations

import itertools
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant

from fedloom.errors import ConfigError
from fedloom.privacy._skellam import (
    DEFAULT_ORDERS,
    calibrate,
    compose_rdp,
    round_rdp,
    skellam_epsilon,
    skellam_rdp,
)


def _gaussian_rdp(orders: list[int], variance: float, l2: float) -> np.ndarray:
    """dp-accounting's RDP of one Gaussian release at sensitivity l2 and this variance."""
    accountant = rdp_privacy_accountant.RdpAccountant(orders=orders)
    accountant.compose(dp_accounting.GaussianDpEvent(math.sqrt(variance) / l2))
    return np.asarray(accountant.rdp)


def test_skellam_rdp_value_at_one_point() -> None:
    # alpha = 2, μ = 100, Δ2 = 10, Δ1 = 30: 2*100/400 = 0.5, plus
    # min((3*100 + 180) / 160000, 90/400) = min(0.003, 0.225) = 0.003.
    assert skellam_rdp([2], 100.0, 30.0, 10.0)[0] == pytest.approx(0.503, rel=1e-12)


@pytest.mark.parametrize("mu", [10.0, 1e3, 1e6, 1e9])
def test_skellam_rdp_bounds_the_gaussian_at_the_same_variance(mu: float) -> None:
    orders = [2, 3, 8, 32, 128]
    l2, l1 = 50.0, 50.0 * math.sqrt(1024)
    skellam = skellam_rdp(orders, mu, l1, l2)
    gaussian = _gaussian_rdp(orders, 2.0 * mu, l2)
    assert np.all(skellam > gaussian)
    if mu >= 1e6:  # the correction is O(1/μ) relative to the Gaussian term
        np.testing.assert_allclose(skellam, gaussian, rtol=1e-4)
    if mu == 10.0:  # and visible when μ is small (here 1.5% at alpha = 128 to 8.5% at alpha = 2)
        assert np.all(skellam > 1.01 * gaussian)


def test_epsilon_falls_as_the_noise_grows() -> None:
    l2 = 100.0
    eps = [skellam_epsilon(DEFAULT_ORDERS, skellam_rdp(DEFAULT_ORDERS, mu, l2 * 32, l2), 1e-5)[0]
           for mu in (1e3, 1e4, 1e5, 1e6)]
    assert all(a > b for a, b in itertools.pairwise(eps))
    assert skellam_epsilon(DEFAULT_ORDERS, skellam_rdp(DEFAULT_ORDERS, 0.0, 1.0, 1.0),
                           1e-5)[0] == math.inf


def test_rounds_compose_by_adding_rdp() -> None:
    params = calibrate(1.0, 10_000, 50, 2.0)
    one = round_rdp(params, 50)
    composed = compose_rdp([one] * 30)
    np.testing.assert_allclose(composed, 30 * one, rtol=1e-12)
    eps, order = skellam_epsilon(DEFAULT_ORDERS, composed, 1e-5)
    assert (eps, order) == rdp_privacy_accountant.compute_epsilon(
        list(DEFAULT_ORDERS), list(30 * one), 1e-5)
    # With 32 bits gamma is huge, so Skellam composes like the Gaussian with z = 2 (up to the
    # O(1/μ) correction and the rounding's norm inflation, both tiny here).
    accountant = rdp_privacy_accountant.RdpAccountant(orders=list(DEFAULT_ORDERS))
    accountant.compose(dp_accounting.GaussianDpEvent(2.0), count=30)
    gaussian_eps = accountant.get_epsilon(1e-5)
    assert gaussian_eps <= eps <= gaussian_eps * 1.001


def test_fewer_survivors_cost_more_privacy() -> None:
    params = calibrate(1.0, 1000, 20, 1.0, dropout_rate=0.25)
    assert np.all(round_rdp(params, 10) > round_rdp(params, 15))
    # at the expected 15 survivors the noise is exactly the target: sigma² = (z c gamma)²
    np.testing.assert_allclose(
        round_rdp(params, 15), skellam_rdp(DEFAULT_ORDERS, (params.scale**2) / 2,
                                           params.l1_bound, params.l2_bound), rtol=1e-12)


@pytest.mark.parametrize("orders", [[1], [2.5], []])
def test_orders_must_be_integers_above_one(orders: list[float]) -> None:
    with pytest.raises(ConfigError, match="orders"):
        skellam_rdp(orders, 10.0, 1.0, 1.0)  # type: ignore[arg-type]
