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
from fedloom.privacy._distributed import SkellamLedger
from fedloom.privacy._skellam import (
    DEFAULT_ORDERS,
    SkellamParams,
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


# -- the distributed mode's ledger ----------------------------------------------------------

LEDGER_DELTA = 1e-5


def _reference_epsilon(rdp: np.ndarray) -> float:
    """dp-accounting's ε of RDP values at `DEFAULT_ORDERS`, called directly."""
    return rdp_privacy_accountant.compute_epsilon(
        [float(a) for a in DEFAULT_ORDERS], [float(v) for v in rdp], LEDGER_DELTA)[0]


def _shares_rdp(params: SkellamParams, noisy: int) -> np.ndarray:
    """Theorem 3.5 at the noise of ``noisy`` shares of Sk(mu_client) each."""
    return skellam_rdp(DEFAULT_ORDERS, noisy * params.client_noise_mu, params.l1_bound,
                       params.l2_bound)


def test_a_fresh_ledger_has_spent_nothing() -> None:
    ledger = SkellamLedger(LEDGER_DELTA)
    assert ledger.epsilon() == 0.0 and ledger.num_rounds == 0


def test_the_ledger_composes_each_rounds_noise_shares() -> None:
    """One noisy share is accounted at its own noise (not as none), a second round adds
    its RDP, and ε is dp-accounting's conversion of the sum."""
    params = calibrate(1.0, 1000, 10, 1.0)
    ledger = SkellamLedger(LEDGER_DELTA)
    one = _shares_rdp(params, 1)
    assert np.all(np.isfinite(one))
    np.testing.assert_allclose(ledger.round_rdp(params, 1), one, rtol=1e-12)
    assert ledger.epsilon_if(params, 1) == pytest.approx(_reference_epsilon(one), rel=1e-9)
    assert ledger.epsilon() == 0.0 and ledger.num_rounds == 0  # a projection spends nothing
    assert ledger.record(params, 1) == pytest.approx(_reference_epsilon(one), rel=1e-9)
    assert ledger.num_rounds == 1
    both = one + _shares_rdp(params, 7)
    assert ledger.epsilon_if(params, 7) == pytest.approx(_reference_epsilon(both), rel=1e-9)
    assert ledger.record(params, 7) == pytest.approx(_reference_epsilon(both), rel=1e-9)
    assert ledger.num_rounds == 2 and ledger.epsilon() == pytest.approx(
        _reference_epsilon(both), rel=1e-9)


@pytest.mark.parametrize("noisy", [0, -1, -3])
def test_a_sum_without_an_honest_noise_share_is_accounted_as_no_privacy(noisy: int) -> None:
    """A sum over no more survivors than colluders and one (`noisy_shares` <= 0) is still a
    release: the ledger records it at infinite RDP rather than refuse to record it."""
    params = calibrate(1.0, 1000, 10, 1.0)
    ledger = SkellamLedger(LEDGER_DELTA)
    ledger.record(params, 5)
    assert np.all(np.isposinf(ledger.round_rdp(params, noisy)))
    assert ledger.epsilon_if(params, noisy) == math.inf
    assert ledger.record(params, noisy) == math.inf
    assert ledger.num_rounds == 2 and ledger.epsilon() == math.inf


def _spent_ledger() -> tuple[SkellamLedger, SkellamParams]:
    params = calibrate(1.0, 1000, 10, 1.0)
    ledger = SkellamLedger(LEDGER_DELTA)
    for noisy in (8, 6, 8):
        ledger.record(params, noisy)
    return ledger, params


def test_the_ledger_state_round_trip_continues_the_same_budget() -> None:
    import json

    ledger, params = _spent_ledger()
    restored = SkellamLedger(LEDGER_DELTA)
    restored.load_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert restored.num_rounds == 3 and restored.state_dict() == ledger.state_dict()
    assert restored.epsilon() == ledger.epsilon()
    assert restored.record(params, 8) == ledger.record(params, 8)
    # a fresh ledger's state (no rounds, all zeros) loads too, as a run checkpointed
    # before its first private round
    fresh = SkellamLedger(LEDGER_DELTA)
    fresh.load_state_dict(json.loads(json.dumps(SkellamLedger(LEDGER_DELTA).state_dict())))
    assert fresh.num_rounds == 0 and fresh.epsilon() == 0.0


def _edited(state: dict, **changes: object) -> dict:
    return {**state, **changes}


def test_a_ledger_of_another_kind_or_shape_is_refused_and_changes_nothing() -> None:
    ledger, _ = _spent_ledger()
    state = ledger.state_dict()
    target, _ = _spent_ledger()
    before = target.state_dict()
    with pytest.raises(ConfigError) as info:
        target.load_state_dict(_edited(state, kind="rdp"))
    assert info.value.setting == "privacy"
    rdp = state["rdp"]
    for broken in (_edited(state, orders=state["orders"][:-1]),  # another set of orders
                   _edited(state, orders=[*state["orders"][:-1], state["orders"][-1] + 1]),
                   _edited(state, rdp=rdp[:-1]),  # a value missing
                   _edited(state, rdp=[*rdp[:-1], -0.5]),  # a negative RDP
                   _edited(state, rounds=-1)):
        with pytest.raises(ValueError):
            target.load_state_dict(broken)
    assert target.state_dict() == before
