"""The distributed Skellam mechanism from client to server: encode, the modular sum,
decode, with and without noise."""

from __future__ import annotations

import math

import numpy as np
import pytest
from skellam_support import clipped, modular_sum, spread_updates

from fedloom.errors import SecureAggregationError
from fedloom.privacy._hadamard import rotate, rotation_signs, unrotate
from fedloom.privacy._skellam import SkellamParams, calibrate, decode_sum, encode


@pytest.mark.parametrize(("sampled", "dropout", "survivors"), [(10, 0.0, 10), (12, 1 / 6, 10)])
def test_noisy_round_trip_has_the_central_noise(sampled: int, dropout: float,
                                                survivors: int) -> None:
    d, c, z = 20_000, 1.0, 1.3
    params = calibrate(c, d, sampled, z, dropout_rate=dropout)
    signs = rotation_signs(b"e2e", params.padded_dimension)
    rng = np.random.default_rng(21)
    updates = spread_updates(survivors, d, c, 22)
    parts = [encode(u, params, signs, rng) for u in updates]
    assert all(p.dtype == np.uint32 and p.shape == (params.padded_dimension,) for p in parts)
    error = decode_sum(modular_sum(parts), params, signs) - sum(clipped(u, c) for u in updates)
    # Survivors carry Sk(μ_total) with 2 μ_total = (z c gamma)²: std z c once unscaled, and
    # the orthonormal un-rotation keeps it per coordinate. Relative standard error of
    # the std of 20000 draws is 1/sqrt(40000) = 0.5%; the mean's is z c / 141.
    assert float(error.std()) == pytest.approx(z * c, rel=0.03)
    assert abs(float(error.mean())) < 6 * z * c / math.sqrt(d)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("bits", [32, 16, 10])
def test_noiseless_round_trip_is_within_the_rounding_error(bits: int, dtype: type) -> None:
    n, d, c = 5, 777, 3.0
    params = calibrate(c, d, n, 0.0, bits=bits)
    assert params.client_noise_mu == 0.0
    signs = rotation_signs(b"noiseless", params.padded_dimension)
    rng = np.random.default_rng(bits)
    updates = [u.astype(dtype) for u in spread_updates(n, d, c, bits)]
    decoded = decode_sum(modular_sum([encode(u, params, signs, rng) for u in updates]),
                         params, signs)
    # Each client's rounding moves each rotated coordinate by < 1 (scaled), so the sum
    # by < n per coordinate: at most n sqrt(d') / gamma in L2 after the orthonormal inverse.
    # A float32 update is rotated in float32: add its relative error (log2(d') levels of
    # 2**-24 each, 6e-7 here) of each clipped norm c.
    bound = n * math.sqrt(params.padded_dimension) / params.scale
    if dtype is np.float32:
        bound += n * c * 1e-6
    expected = sum(clipped(u.astype(np.float64), c) for u in updates)
    assert np.linalg.norm(decoded - expected) <= bound


@pytest.mark.parametrize("bits", [32, 12])
def test_negative_coordinates_wrap_and_still_decode(bits: int) -> None:
    n, d, c = 4, 300, 1.0
    params = calibrate(c, d, n, 0.0, bits=bits)
    signs = rotation_signs(b"wrap", params.padded_dimension)
    rng = np.random.default_rng(31)
    # Every client sends the same vector: the rotated sum has large negative and
    # positive coordinates; each client's negatives are stored as 2**bits - |v|.
    update = spread_updates(1, d, c, 32)[0]
    parts = [encode(update, params, signs, rng) for _ in range(n)]
    assert all(int(p.max()) >= params.modulus // 2 for p in parts)  # negatives, wrapped
    assert all(int(p.max()) < params.modulus for p in parts)
    total = modular_sum(parts)
    decoded = decode_sum(total, params, signs)
    bound = n * math.sqrt(params.padded_dimension) / params.scale
    assert np.linalg.norm(decoded - n * clipped(update, c)) <= bound
    # and the server sees a negative sum where the rotated inputs were negative
    rotated = rotate(clipped(update, c), signs)
    centred = (total.astype(np.int64) % params.modulus)
    assert np.all(centred[rotated < -1.0 / params.scale] >= params.modulus // 2)


def test_decode_refuses_a_sum_of_the_wrong_shape_or_type() -> None:
    params = SkellamParams(clip_norm=1.0, dimension=10, scale=10.0)
    signs = rotation_signs(b"x", 16)
    with pytest.raises(SecureAggregationError):
        decode_sum(np.zeros(10, np.uint32), params, signs)
    with pytest.raises(SecureAggregationError):
        decode_sum(np.zeros(16, np.int32), params, signs)


@pytest.mark.parametrize("bits", [32, 16, 10, 2])
def test_decode_centres_the_ring_at_its_boundaries(bits: int) -> None:
    # Residues below 2**(bits-1) are non-negative, the rest negative; bits above `bits`
    # (a sum taken mod 2**32 of parts reduced mod 2**bits) do not matter.
    params = SkellamParams(clip_norm=1.0, dimension=8, scale=2.0, bits=bits)
    half, ring = 2 ** (bits - 1), 2**bits
    residues = np.array([0, 1, half - 1, half, half + 1, ring - 1, ring - 1, 0], np.int64)
    carries = np.array([0, 3, 1, 0, 7, 2, 0, 5], np.int64)  # multiples of the ring added
    total = ((residues + carries * ring) % 2**32).astype(np.uint32)
    signs = rotation_signs(b"centre", 8)
    expected = unrotate(np.where(residues < half, residues, residues - ring) / 2.0, signs, 8)
    np.testing.assert_allclose(decode_sum(total, params, signs), expected, rtol=0, atol=1e-12)
