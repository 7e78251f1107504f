"""The distributed Skellam mechanism's calibration: the ring holds k sigmas of the
sum, and impossible settings are refused."""

from __future__ import annotations

import numpy as np
import pytest
from skellam_support import clipped, modular_sum, spread_updates

from fedloom.errors import ConfigError
from fedloom.privacy._hadamard import padded_length, rotation_signs
from fedloom.privacy._skellam import (
    DEFAULT_BETA,
    MAX_CLIENT_NOISE_MU,
    SkellamParams,
    calibrate,
    decode_sum,
    encode,
    sample_skellam,
)

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
    update = spread_updates(1, d, c, 42)[0]
    total = modular_sum([encode(update, params, signs, rng) for _ in range(n)])
    error = decode_sum(total, params, signs) - n * clipped(update, c)
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
