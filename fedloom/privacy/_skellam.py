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

import math

import numpy as np

from fedloom.errors import ConfigError, SecureAggregationError
from fedloom.privacy._hadamard import padded_length, unrotate, walsh_hadamard
from fedloom.privacy._skellam_params import (
    DEFAULT_BETA,
    MAX_BITS,
    MAX_CLIENT_NOISE_MU,
    MAX_ROUNDING_ATTEMPTS,
    SkellamParams,
    per_client_noise_mu,
    realised_noise_mu,
    require,
)
from fedloom.privacy._skellam_rdp import (
    DEFAULT_ORDERS,
    compose_rdp,
    round_rdp,
    skellam_epsilon,
    skellam_rdp,
)

#: The mechanism here; its parameters (`_skellam_params`) and its privacy accounting
#: (`_skellam_rdp`) re-exported.
__all__ = [
    "DEFAULT_BETA",
    "DEFAULT_ORDERS",
    "MAX_CLIENT_NOISE_MU",
    "MAX_ROUNDING_ATTEMPTS",
    "SkellamParams",
    "calibrate",
    "compose_rdp",
    "decode_sum",
    "discretize",
    "encode",
    "per_client_noise_mu",
    "realised_noise_mu",
    "round_rdp",
    "sample_skellam",
    "skellam_epsilon",
    "skellam_rdp",
]

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
    draws = rng.poisson(mu, size).astype(np.int64, copy=False)  # already int64 on most
    draws -= rng.poisson(mu, size)  # platforms: no copies
    return draws


# --- client and server ---------------------------------------------------------------


def _norm(values: np.ndarray) -> float:
    """The L2 norm, accumulated in float64 (without a float64 copy of a narrower
    vector); refuses NaN and infinities."""
    with np.errstate(over="ignore", invalid="ignore"):  # checked below
        if values.dtype == np.float64:
            squares = float(np.dot(values, values))
        else:
            squares = float(np.einsum("i,i->", values, values, dtype=np.float64))
    if math.isfinite(squares):
        return math.sqrt(squares)
    if not np.isfinite(values).all():
        raise SecureAggregationError("the update holds non-finite values (NaN or inf)")
    # Finite values whose squares overflow float64 (beyond about 1e154): scaled by the
    # largest magnitude first, so the norm is finite and the update is clipped, not zeroed.
    wide = values.astype(np.float64)
    largest = float(np.max(np.abs(wide)))
    wide /= largest
    return largest * math.sqrt(float(np.dot(wide, wide)))


def _check_shapes(values: np.ndarray, params: SkellamParams, signs: np.ndarray) -> None:
    if values.shape != (params.dimension,):
        raise SecureAggregationError(
            f"the update must be a flat vector of {params.dimension} values, got {values.shape}")
    if signs.shape != (params.padded_dimension,):
        raise SecureAggregationError(
            f"the rotation needs {params.padded_dimension} signs, got {signs.shape}")


#: The update norms for which a narrow update is rotated in float32 (others: float64).
_NARROW_NORMS = (1e-30, 1e30)


def _clipped_rotated(values: np.ndarray, params: SkellamParams, signs: np.ndarray
                     ) -> np.ndarray:
    """Steps 1-2 and the scaling: ``gamma U clip(x)``, float64 of d'.

    The rotation runs on the unit vector (no overflow, whatever the update's norm) in
    the update's own precision: float32 for a float32 model, half the memory traffic of
    float64. Its relative error, about 1e-7, would move a clipped vector's norm past
    ``c gamma`` by more than the rounding bound's slack once ``c gamma`` is large, so
    the norm is enforced again in float64 on the scaled vector that is rounded (the
    rotation is orthonormal: clipping after it is clipping before it).
    """
    norm = _norm(values)
    padded = params.padded_dimension
    if norm == 0:
        return np.zeros(padded)
    # float32 only where 1/norm and the unit vector's entries are normal float32 numbers.
    narrow = values.dtype != np.float64 and _NARROW_NORMS[0] < norm < _NARROW_NORMS[1]
    unit: np.ndarray = np.zeros(padded, np.float32 if narrow else np.float64)
    head = unit[: params.dimension]
    np.multiply(values, signs[: params.dimension], out=head, casting="same_kind")
    np.multiply(head, 1.0 / norm, out=head)
    factor = min(norm, params.clip_norm) * params.scale / math.sqrt(padded)
    scaled = np.multiply(walsh_hadamard(unit), factor, dtype=np.float64)
    length = math.sqrt(float(np.dot(scaled, scaled)))
    bound = params.clip_norm * params.scale
    if length > bound:
        scaled *= bound / length
    return scaled


def _round(scaled: np.ndarray, params: SkellamParams, rng: np.random.Generator) -> np.ndarray:
    """Step 3, conditional randomized rounding of ``scaled``: float64 holding integers.

    ``floor(v + u)`` with ``u`` uniform in [0, 1) is ``floor(v) + 1`` exactly when
    ``u >= 1 - frac(v)``, so with probability ``frac(v)``: stochastic rounding in two
    passes over the vector.
    """
    limit = params.l2_bound**2
    for _ in range(MAX_ROUNDING_ATTEMPTS):
        rounded = rng.random(size=len(scaled))
        rounded += scaled
        np.floor(rounded, out=rounded)
        if float(np.dot(rounded, rounded)) <= limit:
            return rounded
    raise SecureAggregationError(
        f"conditional rounding failed {MAX_ROUNDING_ATTEMPTS} times in a row (each fails "
        f"with probability at most beta={params.beta}); the parameters do not match the "
        "update: recompute them with calibrate()")


def discretize(update: np.ndarray, params: SkellamParams, signs: np.ndarray,
               rng: np.random.Generator) -> np.ndarray:
    """Steps 1-3 (clip, rotate, scale, conditional rounding): the integer vector, int64.

    The result has length d' and squared L2 norm at most ``params.l2_bound ** 2`` (so
    L1 norm at most ``params.l1_bound``). Raises `SecureAggregationError` for an
    update of the wrong shape or with non-finite values, or when every rounding
    attempt fails the norm check (probability at most ``β ** 100``).
    """
    values = np.asarray(update)
    _check_shapes(values, params, signs)
    return _discretized(values, params, signs, rng).astype(np.int64)


def _discretized(values: np.ndarray, params: SkellamParams, signs: np.ndarray,
                 rng: np.random.Generator) -> np.ndarray:
    """Steps 1-3 on a checked update: float64 holding the integer vector."""
    return _round(_clipped_rotated(values, params, signs), params, rng)


def encode(update: np.ndarray, params: SkellamParams, signs: np.ndarray,
           rng: np.random.Generator, noise: np.ndarray | None = None,
           out: np.ndarray | None = None) -> np.ndarray:
    """A client's noisy contribution: uint32 of length d', values below ``2**bits``.

    `discretize`, then ``Sk(params.client_noise_mu)`` per coordinate, then mod
    ``2**bits``. ``update`` (1-D, any float dtype, length ``params.dimension``) is not
    modified; ``signs`` is ``rotation_signs(round_seed, params.padded_dimension)``.
    ``noise``: the ``Sk(params.client_noise_mu)`` draws (int64 of d'), when the caller
    drew them ahead (`NoiseReserve`); they must be fresh and used once, and are
    overwritten. ``out``: a uint32 array of d' to write the result into (returned).
    """
    values = np.asarray(update)
    _check_shapes(values, params, signs)
    padded = params.padded_dimension
    if noise is None:
        noise = sample_skellam(params.client_noise_mu, padded, rng)
    elif noise.shape != (padded,) or noise.dtype != np.int64:
        raise SecureAggregationError(f"the noise must be int64 of shape ({padded},)")
    if out is None:
        out = np.empty(padded, np.uint32)
    elif out.shape != (padded,) or out.dtype != np.uint32:
        raise SecureAggregationError(f"the output must be uint32 of shape ({padded},)")
    # Exact: both terms are integers far below 2**53 (|noise| is a few hundred sigmas
    # of at most sqrt(2**33); the rounded values are bounded by the ring).
    np.add(noise, _discretized(values, params, signs, rng), out=noise, casting="unsafe")
    noise &= params.modulus - 1  # two's complement: the residue mod 2**bits
    np.copyto(out, noise, casting="unsafe")  # below 2**bits <= 2**32: exact
    return out


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
    # Centre by sign extension: shift the low `bits` bits to the top of an int64 and
    # shift back arithmetically.
    shift = np.int64(64 - params.bits)
    centred = (values.astype(np.int64) << shift) >> shift
    return unrotate(np.multiply(centred, 1.0 / params.scale), signs, params.dimension)


# --- calibration ---------------------------------------------------------------------


def calibrate(clip_norm: float, dimension: int, expected_clients: int, noise_multiplier: float,
              *, dropout_rate: float = 0.0, bits: int = MAX_BITS, beta: float = DEFAULT_BETA,
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
    require(clip_norm > 0 and math.isfinite(clip_norm), "clip_norm",
             f"must be a positive number, got {clip_norm!r}")
    require(isinstance(dimension, int) and dimension >= 1, "dimension",
             f"must be a positive integer, got {dimension!r}")
    require(noise_multiplier >= 0 and math.isfinite(noise_multiplier), "noise_multiplier",
             f"must be a number >= 0, got {noise_multiplier!r}")
    require(headroom_sigmas >= 1 and math.isfinite(headroom_sigmas), "headroom_sigmas",
             f"must be a number >= 1, got {headroom_sigmas!r}")
    require(isinstance(bits, int) and 2 <= bits <= MAX_BITS, "bits",
             f"must be an integer in [2, {MAX_BITS}], got {bits!r}")
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
