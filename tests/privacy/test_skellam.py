"""The distributed Skellam mechanism: norm bounds, noise, round trip, RDP, calibration."""

from __future__ import annotations

import itertools
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant
from hypothesis import given, settings
from hypothesis import strategies as st

from fedloom.errors import ConfigError, SecureAggregationError
from fedloom.privacy._hadamard import padded_length, rotate, rotation_signs, unrotate
from fedloom.privacy._skellam import (
    DEFAULT_BETA,
    DEFAULT_ORDERS,
    MAX_CLIENT_NOISE_MU,
    SkellamParams,
    calibrate,
    compose_rdp,
    decode_sum,
    discretize,
    encode,
    per_client_noise_mu,
    realised_noise_mu,
    round_rdp,
    sample_skellam,
    skellam_epsilon,
    skellam_rdp,
)


def _clip(x: np.ndarray, c: float) -> np.ndarray:
    norm = np.linalg.norm(x)
    return x * (c / norm) if norm > c else x


def _modular_sum(parts: list[np.ndarray]) -> np.ndarray:
    """What secure aggregation hands the server: the sum in Z_{2^32} as uint32."""
    return np.asarray(np.sum(np.stack(parts), axis=0, dtype=np.uint32))


# --- parameters and norm bounds ------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("clip_norm", 0.0), ("clip_norm", math.inf), ("dimension", 0), ("scale", -1.0),
     ("bits", 33), ("bits", 1), ("beta", 1.0), ("beta", -0.1), ("client_noise_mu", -1.0),
     ("client_noise_mu", math.nan)],
)
def test_params_refuse_bad_values(field: str, value: float) -> None:
    base = dict(clip_norm=1.0, dimension=10, scale=100.0)
    with pytest.raises(ConfigError, match=field):
        SkellamParams(**{**base, field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("beta", [DEFAULT_BETA, 0.1, 0.99])
@pytest.mark.parametrize(("c", "scale", "d"), [(1.0, 50.0, 1000), (0.1, 3.0, 100), (2.0, 1e6, 3)])
def test_l2_bound_is_the_conditional_rounding_bound(beta: float, c: float, scale: float,
                                                    d: int) -> None:
    # Kairouz-Liu-Steinke's bound in the unscaled domain, on the grid g = 1/scale:
    # ||x~||² <= c² + g² d/4 + sqrt(2 ln(1/β)) g (c + g sqrt(d)/2), or (c + g sqrt(d))²;
    # the integer vector is x~ * scale, so its norm bound is scale times the root.
    params = SkellamParams(clip_norm=c, dimension=d, scale=scale, beta=beta)
    g, dp = 1.0 / scale, padded_length(d)
    conditional = c**2 + g**2 * dp / 4 + math.sqrt(2 * math.log(1 / beta)) * g * (
        c + g * math.sqrt(dp) / 2)
    expected = scale * min(math.sqrt(conditional), c + g * math.sqrt(dp))
    assert params.l2_bound == pytest.approx(expected, rel=1e-12)
    assert params.l1_bound == pytest.approx(expected * min(expected, math.sqrt(dp)), rel=1e-12)


def test_without_beta_the_bound_is_the_plain_rounding_bound() -> None:
    params = SkellamParams(clip_norm=1.0, dimension=100, scale=10.0, beta=0.0)
    assert params.l2_bound == pytest.approx(10.0 + math.sqrt(128))


@settings(max_examples=60, deadline=None)
@given(
    d=st.integers(1, 700),
    norm_ratio=st.floats(0.01, 10.0),
    log_scale=st.floats(-0.5, 5.0),
    beta=st.sampled_from([0.0, 0.1, DEFAULT_BETA, 0.99]),
    seed=st.integers(0, 2**32 - 1),
)
def test_integer_vector_stays_within_the_norm_bounds(d: int, norm_ratio: float,
                                                     log_scale: float, beta: float,
                                                     seed: int) -> None:
    rng = np.random.default_rng(seed)
    c = 1.5
    update = rng.normal(size=d)
    update *= norm_ratio * c / np.linalg.norm(update)
    params = SkellamParams(clip_norm=c, dimension=d, scale=10.0**log_scale, beta=beta)
    signs = rotation_signs(seed.to_bytes(4, "big"), params.padded_dimension)
    integers = discretize(update.astype(np.float32), params, signs, rng)
    assert integers.dtype == np.int64 and integers.shape == (params.padded_dimension,)
    assert float(np.sum(integers.astype(np.float64) ** 2)) <= params.l2_bound**2
    assert float(np.sum(np.abs(integers))) <= params.l1_bound


def _half_integer_update(d: int, scale: float) -> tuple[np.ndarray, SkellamParams, np.ndarray]:
    """An update whose rotated, scaled coordinates are all exactly 1/2.

    Plain stochastic rounding then gives ||z||² ~ Binomial(d, 1/2): mean d/2, sd
    sqrt(d)/2, while with c gamma = sqrt(d)/2 the conditional bound is d/2 + s sqrt(d),
    s = sqrt(2 ln(1/β)); for β = 0.99 (s = 0.14) a plain rounding exceeds it with
    probability P(Z > 2s) = 0.39.
    """
    signs = rotation_signs(b"half", d)
    update = unrotate(np.full(d, 0.5 / scale), signs, d)
    c = float(np.linalg.norm(update)) * (1 + 1e-12)
    return update, SkellamParams(clip_norm=c, dimension=d, scale=scale, beta=0.99), signs


def test_conditional_rounding_resamples_what_plain_rounding_would_not() -> None:
    update, params, signs = _half_integer_update(1024, 8.0)
    rng = np.random.default_rng(5)
    # The control: plain stochastic rounding breaks the bound often (see the helper).
    plain = [rng.random(1024) < 0.5 for _ in range(200)]
    assert sum(int(p.sum()) > params.l2_bound**2 for p in plain) > 40
    for _ in range(100):
        z = discretize(update, params, signs, rng)
        assert float(np.sum(z.astype(np.float64) ** 2)) <= params.l2_bound**2


class _AlwaysRoundUp:
    """A stand-in generator whose uniforms are all 0: every fraction rounds up."""

    def random(self, size: int) -> np.ndarray:
        return np.zeros(size)


def test_rounding_gives_up_with_a_clear_error() -> None:
    update, params, signs = _half_integer_update(1024, 8.0)
    with pytest.raises(SecureAggregationError, match="conditional rounding failed"):
        discretize(update, params, signs, _AlwaysRoundUp())  # type: ignore[arg-type]


def test_clipping_applies_before_rounding() -> None:
    d, c = 3000, 2.0
    params = SkellamParams(clip_norm=c, dimension=d, scale=1e4, beta=DEFAULT_BETA)
    signs = rotation_signs(b"clip", params.padded_dimension)
    update = np.random.default_rng(2).normal(size=d) * 50  # norm about 2700
    z = discretize(update, params, signs, np.random.default_rng(3))
    recovered = unrotate(z / params.scale, signs, d)
    # Rounding moves each rotated coordinate by < 1/gamma: norm error < sqrt(d')/gamma.
    assert np.linalg.norm(recovered - _clip(update, c)) < math.sqrt(params.padded_dimension) / 1e4


@pytest.mark.parametrize("bad", [np.ones(9), np.ones((10, 1)), np.array([np.nan] * 10)])
def test_encode_refuses_a_bad_update(bad: np.ndarray) -> None:
    params = SkellamParams(clip_norm=1.0, dimension=10, scale=10.0)
    with pytest.raises(SecureAggregationError):
        encode(bad, params, rotation_signs(b"x", 16), np.random.default_rng(0))


# --- noise ---------------------------------------------------------------------------


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


def test_zero_noise_is_zero() -> None:
    np.testing.assert_array_equal(sample_skellam(0.0, 7, np.random.default_rng(0)), 0)
    with pytest.raises(ValueError):
        sample_skellam(-1.0, 7, np.random.default_rng(0))


# --- client to server ----------------------------------------------------------------


def _updates(n: int, d: int, c: float, seed: int) -> np.ndarray:
    """Updates with norms from c/4 to 4c, so some are clipped and some not."""
    rng = np.random.default_rng(seed)
    raw = rng.normal(size=(n, d))
    norms = np.linspace(0.25, 4.0, n) * c
    return raw * (norms / np.linalg.norm(raw, axis=1))[:, None]


@pytest.mark.parametrize(("sampled", "dropout", "survivors"), [(10, 0.0, 10), (12, 1 / 6, 10)])
def test_noisy_round_trip_has_the_central_noise(sampled: int, dropout: float,
                                                survivors: int) -> None:
    d, c, z = 20_000, 1.0, 1.3
    params = calibrate(c, d, sampled, z, dropout_rate=dropout)
    signs = rotation_signs(b"e2e", params.padded_dimension)
    rng = np.random.default_rng(21)
    updates = _updates(survivors, d, c, 22)
    parts = [encode(u, params, signs, rng) for u in updates]
    assert all(p.dtype == np.uint32 and p.shape == (params.padded_dimension,) for p in parts)
    error = decode_sum(_modular_sum(parts), params, signs) - sum(_clip(u, c) for u in updates)
    # Survivors carry Sk(μ_total) with 2 μ_total = (z c gamma)²: std z c once unscaled, and
    # the orthonormal un-rotation keeps it per coordinate. Relative standard error of
    # the std of 20000 draws is 1/sqrt(40000) = 0.5%; the mean's is z c / 141.
    assert float(error.std()) == pytest.approx(z * c, rel=0.03)
    assert abs(float(error.mean())) < 6 * z * c / math.sqrt(d)


@pytest.mark.parametrize("bits", [32, 16, 10])
def test_noiseless_round_trip_is_within_the_rounding_error(bits: int) -> None:
    n, d, c = 5, 777, 3.0
    params = calibrate(c, d, n, 0.0, bits=bits)
    assert params.client_noise_mu == 0.0
    signs = rotation_signs(b"noiseless", params.padded_dimension)
    rng = np.random.default_rng(bits)
    updates = _updates(n, d, c, bits)
    decoded = decode_sum(_modular_sum([encode(u, params, signs, rng) for u in updates]),
                         params, signs)
    # Each client's rounding moves each rotated coordinate by < 1 (scaled), so the sum
    # by < n per coordinate: at most n sqrt(d') / gamma in L2 after the orthonormal inverse.
    bound = n * math.sqrt(params.padded_dimension) / params.scale
    assert np.linalg.norm(decoded - sum(_clip(u, c) for u in updates)) <= bound


@pytest.mark.parametrize("bits", [32, 12])
def test_negative_coordinates_wrap_and_still_decode(bits: int) -> None:
    n, d, c = 4, 300, 1.0
    params = calibrate(c, d, n, 0.0, bits=bits)
    signs = rotation_signs(b"wrap", params.padded_dimension)
    rng = np.random.default_rng(31)
    # Every client sends the same vector: the rotated sum has large negative and
    # positive coordinates; each client's negatives are stored as 2**bits - |v|.
    update = _updates(1, d, c, 32)[0]
    parts = [encode(update, params, signs, rng) for _ in range(n)]
    assert all(int(p.max()) >= params.modulus // 2 for p in parts)  # negatives, wrapped
    assert all(int(p.max()) < params.modulus for p in parts)
    total = _modular_sum(parts)
    decoded = decode_sum(total, params, signs)
    bound = n * math.sqrt(params.padded_dimension) / params.scale
    assert np.linalg.norm(decoded - n * _clip(update, c)) <= bound
    # and the server sees a negative sum where the rotated inputs were negative
    rotated = rotate(_clip(update, c), signs)
    centred = (total.astype(np.int64) % params.modulus)
    assert np.all(centred[rotated < -1.0 / params.scale] >= params.modulus // 2)


def test_decode_refuses_a_sum_of_the_wrong_shape_or_type() -> None:
    params = SkellamParams(clip_norm=1.0, dimension=10, scale=10.0)
    signs = rotation_signs(b"x", 16)
    with pytest.raises(SecureAggregationError):
        decode_sum(np.zeros(10, np.uint32), params, signs)
    with pytest.raises(SecureAggregationError):
        decode_sum(np.zeros(16, np.int32), params, signs)


# --- privacy accounting --------------------------------------------------------------


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


# --- calibration ---------------------------------------------------------------------

SETTINGS = [
    # c, d, n, z, p, bits, k, whether the ring (not the Poisson rate) limits gamma
    (1.0, 1_000_000, 100, 1.0, 0.1, 32, 4.0, False),
    (0.1, 5000, 1000, 0.7, 0.3, 32, 3.0, False),
    (1.0, 1000, 10, 0.0, 0.0, 32, 4.0, True),
    (5.0, 17, 3, 2.0, 0.0, 20, 4.0, True),
    (1.0, 100_000, 200, 0.5, 0.05, 16, 3.0, True),
    (1.0, 2**20, 1000, 1.0, 0.2, 24, 4.0, True),
]


@pytest.mark.parametrize(("c", "d", "n", "z", "p", "bits", "k", "ring_bound"), SETTINGS)
def test_calibration_fills_the_ring_with_k_sigmas(c: float, d: int, n: int, z: float, p: float,
                                                  bits: int, k: float, ring_bound: bool) -> None:
    params = calibrate(c, d, n, z, dropout_rate=p, bits=bits, headroom_sigmas=k)
    g, dp = params.scale, padded_length(d)
    # per coordinate of the scaled sum of n clients: aligned signal (c n g)² / d',
    # rounding n/4, noise of all n (none dropped): n μ_client * 2 = (z c g)² / (1 - p).
    variance = (c * n * g) ** 2 / dp + n / 4 + 2 * n * params.client_noise_mu
    ring = (2 ** (bits - 1) / k) ** 2
    assert variance <= ring * (1 + 1e-12)
    if ring_bound:  # gamma is the largest the rule allows
        assert variance == pytest.approx(ring, rel=1e-9)
    else:  # or the largest numpy's Poisson sampler allows
        assert variance < ring / 2
        assert params.client_noise_mu == pytest.approx(MAX_CLIENT_NOISE_MU, rel=1e-8)
        assert params.client_noise_mu <= MAX_CLIENT_NOISE_MU
    # the noise target over the expected survivors: std z c once divided by gamma
    assert 2 * params.client_noise_mu * n * (1 - p) == pytest.approx((z * c * g) ** 2, rel=1e-12)
    assert (params.bits, params.beta, params.dimension) == (bits, DEFAULT_BETA, d)


def test_calibrated_sums_do_not_wrap_even_when_updates_align() -> None:
    # The worst case of the rule: every client sends the same clipped vector. With
    # k = 6 a wrap has probability about 2e-9 per coordinate; one would add an error
    # of 2**16/gamma ≈ 6 sigma... to some coordinate, and show as a spike in the error.
    n, d, c, z = 20, 4096, 1.0, 1.0
    params = calibrate(c, d, n, z, bits=16, headroom_sigmas=6.0)
    signs = rotation_signs(b"align", d)
    rng = np.random.default_rng(41)
    update = _updates(1, d, c, 42)[0]
    total = _modular_sum([encode(update, params, signs, rng) for _ in range(n)])
    error = decode_sum(total, params, signs) - n * _clip(update, c)
    assert float(error.std()) == pytest.approx(z * c, rel=0.08)  # 1/sqrt(8192) = 1.1% SE
    assert float(np.abs(error).max()) < 6 * z * c


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        (dict(expected_clients=100, bits=4), "bits"),  # 4**4 = 256 < 100 * 16
        (dict(bits=40), "bits"),
        (dict(noise_multiplier=-1.0), "noise_multiplier"),
        (dict(dropout_rate=1.0), "dropout_rate"),
        (dict(clip_norm=0.0), "clip_norm"),
        (dict(dimension=0), "dimension"),
        (dict(expected_clients=0), "expected_clients"),
        (dict(headroom_sigmas=0.5), "headroom_sigmas"),
    ],
)
def test_calibration_refuses_impossible_settings(kwargs: dict[str, float], setting: str) -> None:
    base: dict[str, float] = dict(clip_norm=1.0, dimension=1000, expected_clients=10,
                                  noise_multiplier=1.0)
    with pytest.raises(ConfigError, match=setting) as caught:
        calibrate(**{**base, **kwargs})  # type: ignore[arg-type]
    assert caught.value.setting == setting


def test_too_few_bits_says_how_many_are_needed() -> None:
    with pytest.raises(ConfigError, match="at least 6 bits"):
        calibrate(1.0, 1000, 100, 1.0, bits=4, headroom_sigmas=4.0)  # 4**b > 1600 at b = 6


def test_the_noise_parameter_stays_where_numpy_samples_exactly() -> None:
    with pytest.raises(ConfigError, match="client_noise_mu"):
        SkellamParams(clip_norm=1.0, dimension=10, scale=1e9, client_noise_mu=1e15)
    with pytest.raises(ValueError):
        sample_skellam(1e15, 3, np.random.default_rng(0))
