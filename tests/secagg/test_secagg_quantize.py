"""Quantization: the one-quantum-per-client error bound, unbiasedness, no wrap."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from property_budget import examples

from fedloom import Weights
from fedloom.errors import SecureAggregationError
from fedloom.secagg import dequantize, expand_mask, flatten, quantize, unflatten


@settings(max_examples=examples(40), deadline=None)
@given(
    n=st.integers(1, 16),
    bits=st.integers(8, 24),
    clip=st.floats(0.01, 100.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_sum_is_within_one_quantum_per_client(n: int, bits: int, clip: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    vectors = rng.normal(0.0, clip, (n, 50))  # some coordinates beyond the clip range
    weights = rng.uniform(0.01, 1.0, n)
    total = np.zeros(51, np.uint32)
    for vec, w in zip(vectors, weights, strict=True):
        np.add(total, quantize(vec, float(w), clip, bits, rng), out=total)
    weighted, weight = dequantize(total, n, clip, bits)
    expected = (np.clip(vectors, -clip, clip) * weights[:, None]).sum(axis=0)
    quantum = 2 * clip / (2**bits - 1)
    # each client is off by < 1 quantum per coordinate; float64 rounding adds ~1e-12 rel.
    assert np.abs(weighted - expected).max() <= n * quantum * (1 + 1e-9) + 1e-9 * clip
    assert abs(weight - weights.sum()) <= n / (2**bits - 1) * (1 + 1e-9)


def test_stochastic_rounding_is_unbiased() -> None:
    rng = np.random.default_rng(0)
    value = np.full(200_000, 0.3)  # between two levels at 4 bits
    q = quantize(value, 1.0, 1.0, 4, rng)[:-1].astype(np.float64)
    levels = 15
    decoded = q * 2 / levels - 1.0
    assert set(np.unique(q)) <= {9.0, 10.0}  # (0.3 + 1) * 7.5 = 9.75
    assert abs(decoded.mean() - 0.3) < 1e-3  # plain rounding would give 0.3333


def test_largest_round_does_not_wrap() -> None:
    bits, n = 20, 2**12  # bits + log2 n = 32
    top = quantize(np.full(3, 1e9), 1.0, 1.0, bits, np.random.default_rng(0))
    assert top[:-1].tolist() == [2**bits - 1] * 3 and top[-1] == 2**bits - 1
    total = (top.astype(np.uint64) * n).astype(np.uint32)
    assert (top.astype(np.uint64) * n < 2**32).all()
    weighted, weight = dequantize(total, n, 1.0, bits)
    assert np.allclose(weighted, n * 1.0) and weight == pytest.approx(n)
    with pytest.raises(SecureAggregationError, match="wrap"):
        dequantize(total, n + 1, 1.0, bits)


def test_refusals() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(SecureAggregationError, match="non-finite"):
        quantize(np.array([np.nan]), 1.0, 1.0, 8, rng)
    with pytest.raises(SecureAggregationError, match=r"\(0, 1\]"):
        quantize(np.zeros(3), 1.5, 1.0, 8, rng)
    with pytest.raises(SecureAggregationError, match=r"\(0, 1\]"):
        quantize(np.zeros(3), 0.0, 1.0, 8, rng)


def test_flatten_and_unflatten_round_trip() -> None:
    weights = Weights({"a": np.arange(6, dtype=np.float32).reshape(2, 3),
                       "b": np.array(3.5), "n": np.array([4], dtype=np.int64)})
    flat = flatten(weights)
    assert flat.dtype == np.float64 and flat.tolist() == [0, 1, 2, 3, 4, 5, 3.5, 4]
    back = unflatten(flat, weights.specs())
    assert list(back) == ["a", "b", "n"] and back["a"].shape == (2, 3)
    assert back["b"].shape == () and back["n"].dtype == np.float64
    with pytest.raises(SecureAggregationError):
        unflatten(flat[:-1], weights.specs())


def _reference_quantize(values: np.ndarray, weight: float, clip: float, bits: int,
                        rng: np.random.Generator) -> np.ndarray:
    """The formula of `fedloom.secagg._quantize` in one piece: floor((w clip(z) + c) L /
    (2c) + U), the weight floor(w L + U) last, with U = ((word + 2**31) mod 2**32) / 2**32
    for the mask PRG's words of a 32-byte seed drawn from ``rng`` (the documented noise)."""
    levels = float(2**bits - 1)
    words = expand_mask(rng.bytes(32), values.shape[0] + 1).astype(np.int64)
    noise = ((words + 2**31) % 2**32) / 2.0**32
    body = (weight * np.clip(values.astype(np.float64), -clip, clip) + clip) * levels / (2 * clip)
    scaled = np.append(body, weight * levels) + noise
    return np.minimum(np.floor(scaled), levels).astype(np.uint32)


@pytest.mark.parametrize("n", [0, 1, 7, 65_535, 65_536, 65_537, 200_003])
def test_blocked_quantization_equals_the_formula(n: int) -> None:
    # quantize works block by block (65 536 values): across block edges, and for float32
    # input (widened per block), it gives exactly the one-piece formula's integers, up to
    # a rare off-by-one where float64 rounds the two algebraic forms differently.
    values = np.random.default_rng(n).normal(0.0, 3.0, n)
    for vec in (values, values.astype(np.float32)):
        got = quantize(vec, 0.37, 8.0, 22, np.random.default_rng(1)).astype(np.int64)
        want = _reference_quantize(vec, 0.37, 8.0, 22, np.random.default_rng(1))
        diff = np.abs(got - want.astype(np.int64))
        assert diff.max() <= 1 and (diff > 0).mean() < 1e-4


def test_rounding_noise_depends_on_the_rng() -> None:
    values = np.full(1000, 0.123456)
    a = quantize(values, 1.0, 1.0, 8, np.random.default_rng(1))
    b = quantize(values, 1.0, 1.0, 8, np.random.default_rng(1))
    c = quantize(values, 1.0, 1.0, 8, np.random.default_rng(2))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_non_finite_values_in_a_later_block_are_refused() -> None:
    values = np.zeros(70_000)
    values[69_999] = np.inf
    with pytest.raises(SecureAggregationError, match="non-finite"):
        quantize(values, 1.0, 1.0, 8, np.random.default_rng(0))


def test_flatten_can_keep_the_tensors_dtype() -> None:
    one = Weights({"a": np.arange(6, dtype=np.float32)})
    kept = flatten(one, dtype=None)
    assert kept.dtype == np.float32 and kept.tolist() == list(range(6))
    mixed = Weights([("a", np.zeros(2, np.float32)), ("n", np.array([4], dtype=np.int64))])
    assert flatten(mixed, dtype=None).dtype == np.float64  # int64 needs float64
    assert flatten(Weights({}), dtype=None).shape == (0,)
