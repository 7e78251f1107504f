"""The distributed Skellam mechanism's parameters and norm bounds: conditional rounding
keeps every client's integer vector within them."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from property_budget import examples
from skellam_support import clipped

from fedloom.errors import ConfigError, SecureAggregationError
from fedloom.privacy._hadamard import padded_length, rotation_signs, unrotate
from fedloom.privacy._skellam import (
    DEFAULT_BETA,
    MAX_CLIENT_NOISE_MU,
    SkellamParams,
    discretize,
    encode,
)


@pytest.mark.parametrize(
    ("field", "value"),
    [("clip_norm", 0.0), ("clip_norm", math.inf), ("dimension", 0), ("scale", -1.0),
     ("scale", 0.0), ("bits", 33), ("bits", 1), ("beta", 1.0), ("beta", -0.1),
     ("client_noise_mu", -1.0), ("client_noise_mu", math.nan)],
)
def test_params_refuse_bad_values(field: str, value: float) -> None:
    base = dict(clip_norm=1.0, dimension=10, scale=100.0)
    with pytest.raises(ConfigError, match=field):
        SkellamParams(**{**base, field: value})  # type: ignore[arg-type]



def test_client_noise_may_reach_the_sampler_limit_and_no_further() -> None:
    """The calibration caps the noise at `MAX_CLIENT_NOISE_MU` (numpy's Poisson sampler
    is exact up to there): the cap itself is a valid setting, anything above is not."""
    base = dict(clip_norm=1.0, dimension=10, scale=100.0)
    assert SkellamParams(**base, client_noise_mu=MAX_CLIENT_NOISE_MU).client_noise_mu == 2.0**32
    with pytest.raises(ConfigError, match="client_noise_mu"):
        SkellamParams(**base, client_noise_mu=math.nextafter(MAX_CLIENT_NOISE_MU, math.inf))


def test_the_defaults_are_the_papers_beta_and_no_noise() -> None:
    """Δ2 (and so every ε) depends on β: the default is the e^-0.5 of Kairouz, Liu &
    Steinke and Agarwal, Kairouz & Liu; a client adds noise only when told to."""
    params = SkellamParams(clip_norm=1.0, dimension=10, scale=100.0)
    assert params.beta == DEFAULT_BETA == math.exp(-0.5)
    assert params.client_noise_mu == 0.0

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


@settings(max_examples=examples(60), deadline=None)
@given(
    d=st.integers(1, 700),
    norm_ratio=st.floats(0.01, 10.0),
    log_scale=st.floats(-0.5, 10.0),  # c gamma up to 1.5e10: float32 rotation errors matter
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


@pytest.mark.parametrize("d", [3, 700, 5000])
@pytest.mark.parametrize("log_scale", [7.0, 9.0, 10.0])
def test_a_clipped_float32_update_rounds_within_the_bound_at_any_scale(
        d: int, log_scale: float) -> None:
    # The rotation runs in float32 for a float32 update; its ~1e-7 relative error is
    # far more than the bound's slack once c gamma is 1e9, unless the norm is enforced
    # again on the scaled vector (here every attempt would fail the norm check).
    rng = np.random.default_rng(d)
    update = rng.normal(size=d)
    update *= 3.0 / np.linalg.norm(update)  # clipped to c = 1
    params = SkellamParams(clip_norm=1.0, dimension=d, scale=10.0**log_scale)
    signs = rotation_signs(b"wide", params.padded_dimension)
    for _ in range(5):
        integers = discretize(update.astype(np.float32), params, signs, rng)
        assert float(np.sum(integers.astype(np.float64) ** 2)) <= params.l2_bound**2


@pytest.mark.parametrize(("value", "dtype"), [(1e-42, np.float32), (1e-35, np.float32),
                                              (3e38, np.float32), (1e300, np.float64)])
def test_an_update_of_extreme_norm_still_rounds_within_the_bound(value: float,
                                                                 dtype: type) -> None:
    # Subnormal float32 entries (1/norm would overflow float32), entries near float32's
    # maximum (the rotation falls back to float64), float64 entries whose squares
    # overflow (the norm is taken scaled): clipped to c, within the bound.
    d = 1000
    update = np.full(d, value, dtype)
    update[::2] *= -1
    params = SkellamParams(clip_norm=1.0, dimension=d, scale=1e4)
    signs = rotation_signs(b"extreme", params.padded_dimension)
    integers = discretize(update, params, signs, np.random.default_rng(0))
    norm = float(np.linalg.norm(integers.astype(np.float64)))
    assert norm <= params.l2_bound
    if value > 1:  # clipped to c: the rounded norm is c gamma give or take the rounding
        assert abs(norm - 1e4) <= math.sqrt(params.padded_dimension)


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
    """A stand-in generator whose uniforms are all just below 1: every fraction rounds up."""

    def random(self, size: int) -> np.ndarray:
        return np.full(size, np.nextafter(1.0, 0.0))


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
    assert np.linalg.norm(recovered - clipped(update, c)) < math.sqrt(params.padded_dimension) / 1e4


@pytest.mark.parametrize("bad", [np.ones(9), np.ones((10, 1)), np.array([np.nan] * 10)])
def test_encode_refuses_a_bad_update(bad: np.ndarray) -> None:
    params = SkellamParams(clip_norm=1.0, dimension=10, scale=10.0)
    with pytest.raises(SecureAggregationError):
        encode(bad, params, rotation_signs(b"x", 16), np.random.default_rng(0))
