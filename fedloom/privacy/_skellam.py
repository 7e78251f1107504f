"""The distributed Skellam mechanism: what clients add before secure aggregation.

Agarwal, Kairouz & Liu, "The Skellam Mechanism for Differentially Private Federated
Learning", NeurIPS 2021 (arXiv 2110.04995), Algorithm 1. Each client

1. clips its flattened float update ``x`` to L2 norm ``c``;
2. rotates it, ``U x`` with the public randomized Hadamard ``U`` (`_hadamard`), so every
   coordinate is about ``||x|| / sqrt(d')`` (``d'`` the padded dimension);
3. scales by ``gamma`` and rounds each coordinate stochastically to an integer, resampling
   the whole rounding until the squared L2 norm is at most ``Δ2²`` (conditional
   randomized rounding, Kairouz, Liu & Steinke, ICML 2021, section 4.1);
4. adds symmetric Skellam noise ``Sk(μ_client) = Poisson(μ_client) - Poisson(μ_client)``
   to every coordinate;
5. reduces modulo ``2**bits`` (uint32), ready to be masked and summed in Z_{2^32}.

The server centres the modular sum into ``[-2**(bits-1), 2**(bits-1))``, divides by
``gamma`` and rotates back (`decode_sum`): the sum of the clipped updates plus noise of
variance ``2 μ_total / gamma²`` per coordinate, where ``μ_total`` is the sum of the
survivors' ``μ_client`` (Skellam is closed under summation).

**Parameterisation, used everywhere here**: ``Sk(μ)`` is the difference of two
independent ``Poisson(μ)``; its variance is ``2 μ``. All norms, ``μ`` and sensitivities
live in the scaled integer domain (after ``* gamma``).

**Sensitivity** of one client's integer vector ``z`` (Kairouz, Liu & Steinke 2021,
Theorem 1 and section 4.1: the norm bound of conditional randomized rounding, here
with rounding grid 1 after scaling by ``gamma``)::

    Δ2 = min( c gamma + sqrt(d'),
              sqrt( (c gamma)² + d'/4 + sqrt(2 ln(1/β)) (c gamma + sqrt(d')/2) ) )
    Δ1 = min( Δ2², sqrt(d') Δ2 )

The first term holds for plain stochastic rounding (every coordinate moves by less
than 1); the second is what the resampling guarantees, and is used only for ``β > 0``.
``Δ1 <= Δ2²`` because ``|z_i| <= z_i²`` for integers; ``Δ1 <= sqrt(d') Δ2`` is
Cauchy-Schwarz.

**Privacy** (`skellam_rdp`): Agarwal et al. 2021, Theorem 3.5 (multi-dimensional
Skellam mechanism): adding ``Sk(μ)`` per coordinate to a vector of L1/L2 sensitivity
``Δ1``/``Δ2`` is ``(alpha, ε(alpha))``-RDP for integer ``alpha > 1`` with::

    ε(alpha) = alpha Δ2² / (4 μ) + min( ((2 alpha - 1) Δ2² + 6 Δ1) / (16 μ²),  3 Δ1 / (4 μ) )

The first term is the Gaussian mechanism's RDP at the same variance ``sigma² = 2μ``; the
rest vanishes as ``μ`` grows. The sensitivity is one client's whole integer vector
with the survivors' noise held fixed (the client's vector replaced by zeros); for the
replace-one relation pass ``2 Δ1`` and ``2 Δ2``. RDP adds up over rounds (Mironov
2017, Proposition 1) and dp-accounting converts it to (ε, δ). There is **no
amplification by sampling**: dp-accounting has no subsampled-Skellam bound, and
borrowing the subsampled-Gaussian bound through the Gaussian approximation of Skellam
would not be a proof.

Honest limits: ``μ_client`` is set for the *expected* number of survivors, so a round
with fewer survivors has less noise than targeted; account with the realised
``μ_total`` (`round_rdp`). Noise from clients that collude with the server protects
nobody; count only clients you trust to have added theirs. The modular sum can still
wrap with the small probability chosen by the calibration's headroom (`calibrate`);
a wrapped coordinate of the rotated sum spreads its error over all coordinates.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from fedloom.errors import ConfigError, SecureAggregationError
from fedloom.privacy._hadamard import padded_length, rotate, unrotate

#: The conditional-rounding β the papers recommend and use in their experiments
#: (Kairouz, Liu & Steinke 2021; Agarwal, Kairouz & Liu 2021): each rounding attempt
#: fails the norm check with probability at most β.
DEFAULT_BETA = math.exp(-0.5)

#: Attempts at conditional rounding before giving up: with β = e^-0.5 all of them fail
#: with probability at most e^-50.
MAX_ROUNDING_ATTEMPTS = 100

#: Integer RDP orders (the bound of Theorem 3.5 is stated for integer alpha > 1).
DEFAULT_ORDERS: tuple[int, ...] = (*range(2, 257), 320, 384, 512, 768, 1024)

#: The largest Poisson rate a client may draw. numpy's sampler (PTRS, Hörmann 1993)
#: tests acceptance with ``k log(λ) - λ - log(k!)``, terms near ``λ log λ`` whose
#: float64 rounding grows with λ. Measured on 4M draws (numpy 2.4): from 1e13 a KS test
#: against the normal limit fails, at 1e14 the variance is 0.7% high, at 1e16 41%.
#: At 2**32 those terms are about 1e11 and round by about 1e-5, so the sampled law is
#: Poisson to that relative accuracy (and passes the same checks). The calibration
#: lowers gamma to respect it, at a negligible cost: the rounding's ``d'/4`` in Δ2²
#: stays tiny against ``(c gamma)² = 2**33 n (1 - p) / z²`` (1e-5 of it at d' = 2**20,
#: z = 2, 10 survivors).
MAX_CLIENT_NOISE_MU = float(2**32)

_MAX_BITS = 32  # the secure-aggregation ring is Z_{2^32}


@dataclasses.dataclass(frozen=True)
class SkellamParams:
    """What every client and the server of a round must agree on.

    Attributes:
        clip_norm: c, the L2 norm each flattened float update is clipped to.
        dimension: d, the length of the flattened update.
        scale: gamma, the factor applied after rotation and before rounding.
        bits: the modulus is ``2**bits`` (at most 32: the values travel as uint32 and
            are summed in Z_{2^32}, a multiple of ``2**bits``).
        beta: β of conditional randomized rounding, in [0, 1); 0 means plain
            stochastic rounding (and the looser ``Δ2 = c gamma + sqrt(d')``).
        client_noise_mu: μ_client, the Skellam parameter each client adds per
            coordinate (variance ``2 μ_client``); 0 adds no noise.
    """

    clip_norm: float
    dimension: int
    scale: float
    bits: int = _MAX_BITS
    beta: float = DEFAULT_BETA
    client_noise_mu: float = 0.0

    def __post_init__(self) -> None:
        _require(self.clip_norm > 0 and math.isfinite(self.clip_norm), "clip_norm",
                 f"must be a positive number, got {self.clip_norm!r}")
        _require(isinstance(self.dimension, int) and self.dimension >= 1, "dimension",
                 f"must be a positive integer, got {self.dimension!r}")
        _require(self.scale > 0 and math.isfinite(self.scale), "scale",
                 f"must be a positive number, got {self.scale!r}")
        _require(isinstance(self.bits, int) and 2 <= self.bits <= _MAX_BITS, "bits",
                 f"must be an integer in [2, {_MAX_BITS}], got {self.bits!r}")
        _require(0.0 <= self.beta < 1.0, "beta", f"must be in [0, 1), got {self.beta!r}")
        _require(0 <= self.client_noise_mu <= MAX_CLIENT_NOISE_MU, "client_noise_mu",
                 f"must be in [0, {MAX_CLIENT_NOISE_MU:.0f}] (numpy's Poisson sampler is "
                 f"inexact above), got {self.client_noise_mu!r}; lower the scale")

    @property
    def padded_dimension(self) -> int:
        """d', the dimension rotated, rounded and summed (a power of two >= d)."""
        return padded_length(self.dimension)

    @property
    def modulus(self) -> int:
        """``2**bits``."""
        return 1 << self.bits

    @property
    def l2_bound(self) -> float:
        """Δ2, the L2 norm bound of one client's integer vector (module docstring)."""
        scaled_clip, dim = self.clip_norm * self.scale, float(self.padded_dimension)
        plain = scaled_clip + math.sqrt(dim)
        if self.beta == 0.0:
            return plain
        squared = scaled_clip**2 + dim / 4.0 + math.sqrt(2.0 * math.log(1.0 / self.beta)) * (
            scaled_clip + math.sqrt(dim) / 2.0
        )
        return min(plain, math.sqrt(squared))

    @property
    def l1_bound(self) -> float:
        """Δ1 = min(Δ2², sqrt(d') Δ2), the L1 norm bound of one client's integer vector."""
        l2 = self.l2_bound
        return l2 * min(l2, math.sqrt(self.padded_dimension))


def _require(condition: bool, setting: str, problem: str) -> None:
    if not condition:
        raise ConfigError(setting, problem)


# --- noise ---------------------------------------------------------------------------


def sample_skellam(mu: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` draws of symmetric Skellam ``Sk(mu) = Poisson(mu) - Poisson(mu)``; int64.

    Mean 0, variance exactly ``2 * mu``. ``mu = 0`` gives zeros. ``mu`` above
    `MAX_CLIENT_NOISE_MU` is refused: numpy's Poisson draws are inexact there.
    """
    if not 0 <= mu <= MAX_CLIENT_NOISE_MU:
        raise ValueError(f"the Skellam parameter must be in [0, {MAX_CLIENT_NOISE_MU:.0f}], "
                         f"got {mu!r}")
    if mu == 0:
        return np.zeros(size, dtype=np.int64)
    return rng.poisson(mu, size).astype(np.int64) - rng.poisson(mu, size).astype(np.int64)


def per_client_noise_mu(total_mu: float, expected_clients: int, dropout_rate: float) -> float:
    """μ_client such that the expected ``n (1 - p)`` survivors together add ``Sk(total_mu)``.

    Sums of independent ``Sk(μ_i)`` are ``Sk(Σ μ_i)``, so each client adds
    ``total_mu / (n (1 - p))``.
    """
    _require(isinstance(expected_clients, int) and expected_clients >= 1, "expected_clients",
             f"must be a positive integer, got {expected_clients!r}")
    _require(0.0 <= dropout_rate < 1.0, "dropout_rate", f"must be in [0, 1), got {dropout_rate!r}")
    _require(total_mu >= 0 and math.isfinite(total_mu), "total_mu",
             f"must be a number >= 0, got {total_mu!r}")
    return total_mu / (expected_clients * (1.0 - dropout_rate))


def realised_noise_mu(client_noise_mu: float, noisy_clients: int) -> float:
    """μ_total of the sum when ``noisy_clients`` clients each added ``Sk(client_noise_mu)``."""
    if noisy_clients < 0:
        raise ValueError(f"the number of noisy clients must be >= 0, got {noisy_clients}")
    return client_noise_mu * noisy_clients


# --- client and server ---------------------------------------------------------------


def discretize(update: np.ndarray, params: SkellamParams, signs: np.ndarray,
               rng: np.random.Generator) -> np.ndarray:
    """Steps 1-3 (clip, rotate, scale, conditional rounding): the integer vector, int64.

    The result has length d' and squared L2 norm at most ``params.l2_bound ** 2`` (so
    L1 norm at most ``params.l1_bound``). Raises `SecureAggregationError` for an
    update of the wrong shape or with non-finite values, or when every rounding
    attempt fails the norm check (probability at most ``β ** 100``).
    """
    values = np.asarray(update)
    if values.shape != (params.dimension,):
        raise SecureAggregationError(
            f"the update must be a flat vector of {params.dimension} values, got {values.shape}")
    if signs.shape != (params.padded_dimension,):
        raise SecureAggregationError(
            f"the rotation needs {params.padded_dimension} signs, got {signs.shape}")
    flat = values.astype(np.float64)
    if not np.isfinite(flat).all():
        raise SecureAggregationError("the update holds non-finite values (NaN or inf)")
    norm = float(np.linalg.norm(flat))
    if norm > params.clip_norm:
        flat *= params.clip_norm / norm
    scaled = rotate(flat, signs)
    scaled *= params.scale
    floor = np.floor(scaled)
    fraction = scaled - floor
    limit = params.l2_bound**2
    for _ in range(MAX_ROUNDING_ATTEMPTS):
        rounded = floor + (rng.random(fraction.shape[0]) < fraction)
        if float(np.dot(rounded, rounded)) <= limit:
            return rounded.astype(np.int64)
    raise SecureAggregationError(
        f"conditional rounding failed {MAX_ROUNDING_ATTEMPTS} times in a row (each fails "
        f"with probability at most beta={params.beta}); the parameters do not match the "
        "update: recompute them with calibrate()")


def encode(update: np.ndarray, params: SkellamParams, signs: np.ndarray,
           rng: np.random.Generator, noise: np.ndarray | None = None) -> np.ndarray:
    """A client's noisy contribution: uint32 of length d', values below ``2**bits``.

    `discretize`, then ``Sk(params.client_noise_mu)`` per coordinate, then mod
    ``2**bits``. ``update`` (1-D, any float dtype, length ``params.dimension``) is not
    modified; ``signs`` is ``rotation_signs(round_seed, params.padded_dimension)``.
    ``noise``: the ``Sk(params.client_noise_mu)`` draws (int64 of d'), when the caller
    drew them ahead (`NoiseReserve`); they must be fresh and used once.
    """
    integers = discretize(update, params, signs, rng)
    if noise is None:
        noise = sample_skellam(params.client_noise_mu, integers.shape[0], rng)
    elif noise.shape != integers.shape or noise.dtype != np.int64:
        raise SecureAggregationError(f"the noise must be int64 of shape {integers.shape}")
    integers += noise
    return np.mod(integers, params.modulus).astype(np.uint32)


def decode_sum(total: np.ndarray, params: SkellamParams, signs: np.ndarray) -> np.ndarray:
    """The server's estimate of the SUM of the clipped updates (plus noise), float64 of d.

    ``total`` is the sum of the clients' `encode` outputs modulo ``2**32`` (or any
    multiple of ``2**bits``), as unsigned integers of length d'. It is reduced mod
    ``2**bits``, centred into ``[-2**(bits-1), 2**(bits-1))``, divided by gamma and rotated
    back. Divide by the number of survivors for the mean.
    """
    values = np.asarray(total)
    if values.shape != (params.padded_dimension,) or values.dtype.kind != "u":
        raise SecureAggregationError(
            f"the modular sum must be unsigned integers of shape ({params.padded_dimension},),"
            f" got {values.dtype} of shape {values.shape}")
    if signs.shape != (params.padded_dimension,):
        raise SecureAggregationError(
            f"the rotation needs {params.padded_dimension} signs, got {signs.shape}")
    centred = values.astype(np.int64) & (params.modulus - 1)
    centred[centred >= params.modulus // 2] -= params.modulus
    return unrotate(centred / params.scale, signs, params.dimension)


# --- privacy accounting --------------------------------------------------------------


def _check_orders(orders: Sequence[int]) -> np.ndarray:
    array = np.asarray(orders, dtype=np.float64)
    if array.ndim != 1 or array.size == 0 or not np.all((array >= 2) & (array == np.round(array))):
        raise ConfigError("orders", "must be a non-empty list of integers >= 2 (Theorem 3.5 "
                          "holds for integer orders)")
    return array


def skellam_rdp(orders: Sequence[int], mu_total: float, l1: float, l2: float) -> np.ndarray:
    """RDP ε(alpha) of adding ``Sk(mu_total)`` per coordinate at sensitivities ``l1``, ``l2``.

    Agarwal, Kairouz & Liu 2021, Theorem 3.5 (formula in the module docstring), all in
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
    improved bound); no amplification by sampling (module docstring).
    """
    alpha = _check_orders(orders)
    _require(0.0 < delta < 1.0, "delta", f"must be in (0, 1), got {delta!r}")
    values = np.asarray(rdp, dtype=np.float64)
    if values.shape != alpha.shape:
        raise ConfigError("rdp", f"needs one value per order ({alpha.size}), got {values.shape}")
    # dp-accounting takes most of a second to import: only the server's accounting pays.
    from dp_accounting.rdp import rdp_privacy_accountant

    epsilon, order = rdp_privacy_accountant.compute_epsilon(
        [float(a) for a in alpha], [float(v) for v in values], delta)
    return float(epsilon), int(order)


# --- calibration ---------------------------------------------------------------------


def calibrate(clip_norm: float, dimension: int, expected_clients: int, noise_multiplier: float,
              *, dropout_rate: float = 0.0, bits: int = _MAX_BITS, beta: float = DEFAULT_BETA,
              headroom_sigmas: float = 4.0) -> SkellamParams:
    """Parameters that match central noise ``z c`` on the sum and leave the ring unwrapped.

    The noise target: the survivors' total ``Sk(μ_total)`` has variance
    ``2 μ_total = (z c gamma)²``, i.e. standard deviation ``z c`` once divided by gamma, as the
    central Gaussian mechanism with noise multiplier z would add.

    The no-wrap rule (Kairouz, Liu & Steinke 2021, section 4.4; the rule of the
    papers' experiments): with n clients, a coordinate of the rotated, scaled sum has
    variance at most ``gamma² c² n² / d'`` (all updates aligned, spread evenly by the
    rotation), plus ``n / 4`` of rounding, plus the noise ``(z c gamma)² / (1 - p)`` should
    none of the n drop out. gamma is the largest value for which ``k`` standard deviations
    fit in half the ring::

        k² (gamma² (c² n² / d' + z² c² / (1 - p)) + n / 4) = 4**(bits - 1)

    which needs ``4**bits > n k²``. The per-coordinate wrap probability is then about
    that of a Gaussian beyond k sigmas (k = 4: 6e-5), and smaller in practice since
    updates rarely align. If that gamma would make ``μ_client`` exceed
    `MAX_CLIENT_NOISE_MU` (32 bits leave room for far more), gamma is lowered until it
    does not, and the ring is not filled. ``z = 0`` calibrates a noiseless
    (non-private) round.
    """
    _require(clip_norm > 0 and math.isfinite(clip_norm), "clip_norm",
             f"must be a positive number, got {clip_norm!r}")
    _require(isinstance(dimension, int) and dimension >= 1, "dimension",
             f"must be a positive integer, got {dimension!r}")
    _require(noise_multiplier >= 0 and math.isfinite(noise_multiplier), "noise_multiplier",
             f"must be a number >= 0, got {noise_multiplier!r}")
    _require(headroom_sigmas >= 1 and math.isfinite(headroom_sigmas), "headroom_sigmas",
             f"must be a number >= 1, got {headroom_sigmas!r}")
    _require(isinstance(bits, int) and 2 <= bits <= _MAX_BITS, "bits",
             f"must be an integer in [2, {_MAX_BITS}], got {bits!r}")
    per_client_noise_mu(0.0, expected_clients, dropout_rate)  # validates n and p
    n, k = expected_clients, headroom_sigmas
    room = 4.0 ** (bits - 1) / k**2 - n / 4.0
    if room <= 0:
        needed = math.ceil(math.log2(n * k**2) / 2.0 + 1e-12)
        raise ConfigError("bits", f"{bits} bits cannot hold the rounding of {n} clients with "
                          f"{k:g} sigmas of headroom: use at least {needed} bits, fewer clients "
                          "per round, or a smaller headroom_sigmas")
    d_padded = padded_length(dimension)
    per_gamma = clip_norm**2 * (n**2 / d_padded + noise_multiplier**2 / (1.0 - dropout_rate))
    scale = math.sqrt(room / per_gamma)
    if noise_multiplier > 0:  # keep μ_client = (z c gamma)² / (2 n (1 - p)) samplable
        survivors = n * (1.0 - dropout_rate)
        scale = min(scale, math.sqrt(2.0 * MAX_CLIENT_NOISE_MU * survivors)
                    / (noise_multiplier * clip_norm) * (1.0 - 1e-9))  # rounding margin
    total_mu = (noise_multiplier * clip_norm * scale) ** 2 / 2.0
    return SkellamParams(
        clip_norm=float(clip_norm), dimension=dimension, scale=scale, bits=bits,
        beta=float(beta), client_noise_mu=per_client_noise_mu(total_mu, n, dropout_rate))
