"""The privacy of the distributed Skellam mechanism: per-round RDP, composition and ε.

Agarwal, Kairouz & Liu 2021, Theorem 3.5 (the bound and its conditions are in
`fedloom.privacy._skellam`'s docstring); RDP adds up over rounds (Mironov 2017) and
dp-accounting converts it to (ε, δ).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fedloom.errors import ConfigError
from fedloom.privacy._skellam_params import SkellamParams, realised_noise_mu, require

#: Integer RDP orders (the bound of Theorem 3.5 is stated for integer alpha > 1).
DEFAULT_ORDERS: tuple[int, ...] = (*range(2, 257), 320, 384, 512, 768, 1024)


# --- privacy accounting --------------------------------------------------------------


def _check_orders(orders: Sequence[int]) -> np.ndarray:
    array = np.asarray(orders, dtype=np.float64)
    if array.ndim != 1 or array.size == 0 or not np.all((array >= 2) & (array == np.round(array))):
        raise ConfigError("orders", "must be a non-empty list of integers >= 2 (Theorem 3.5 "
                          "holds for integer orders)")
    return array


def skellam_rdp(orders: Sequence[int], mu_total: float, l1: float, l2: float) -> np.ndarray:
    """RDP ε(alpha) of adding ``Sk(mu_total)`` per coordinate at sensitivities ``l1``, ``l2``.

    Agarwal, Kairouz & Liu 2021, Theorem 3.5 (formula in `fedloom.privacy._skellam`'s
    docstring), all in
    the scaled integer domain. ``mu_total = 0`` gives infinity (no noise, no privacy)
    unless the sensitivity is zero.
    """
    alpha = _check_orders(orders)
    if not (mu_total >= 0 and math.isfinite(mu_total)) or not (l1 >= 0 and l2 >= 0):
        raise ConfigError("mu_total", f"mu_total, l1 and l2 must be >= 0, got {mu_total}, "
                          f"{l1}, {l2}")
    if l2 == 0 and l1 == 0:
        return np.zeros_like(alpha)
    if mu_total == 0:
        return np.full_like(alpha, np.inf)
    gaussian = alpha * l2**2 / (4.0 * mu_total)
    correction = np.minimum(((2.0 * alpha - 1.0) * l2**2 + 6.0 * l1) / (16.0 * mu_total**2),
                            3.0 * l1 / (4.0 * mu_total))
    return gaussian + correction


def round_rdp(params: SkellamParams, noisy_clients: int,
              orders: Sequence[int] = DEFAULT_ORDERS) -> np.ndarray:
    """One round's RDP when ``noisy_clients`` clients' noise is in the sum.

    Pass the survivors whose masked input was summed (minus any the server may collude
    with); the sensitivities are ``params.l1_bound`` and ``params.l2_bound``.
    """
    mu_total = realised_noise_mu(params.client_noise_mu, noisy_clients)
    return skellam_rdp(orders, mu_total, params.l1_bound, params.l2_bound)


def compose_rdp(rdp_per_round: Sequence[np.ndarray]) -> np.ndarray:
    """RDP of several rounds at the same orders: the sum (Mironov 2017, Proposition 1)."""
    if not rdp_per_round:
        raise ValueError("compose at least one round")
    return np.sum(np.stack([np.asarray(r, dtype=np.float64) for r in rdp_per_round]), axis=0)


def skellam_epsilon(orders: Sequence[int], rdp: np.ndarray, delta: float) -> tuple[float, int]:
    """(ε, the best order) at ``delta`` for composed RDP values, by dp-accounting.

    The conversion is ``rdp_privacy_accountant.compute_epsilon`` (Balle et al. 2020's
    improved bound); no amplification by sampling (`fedloom.privacy._skellam`'s
    docstring).
    """
    alpha = _check_orders(orders)
    require(0.0 < delta < 1.0, "delta", f"must be in (0, 1), got {delta!r}")
    values = np.asarray(rdp, dtype=np.float64)
    if values.shape != alpha.shape:
        raise ConfigError("rdp", f"needs one value per order ({alpha.size}), got {values.shape}")
    # dp-accounting takes most of a second to import: only the server's accounting pays.
    from dp_accounting.rdp import rdp_privacy_accountant

    epsilon, order = rdp_privacy_accountant.compute_epsilon(
        [float(a) for a in alpha], [float(v) for v in values], delta)
    return float(epsilon), int(order)
