"""The randomized Hadamard rotation: exact inverse, norm kept, public and deterministic."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from property_budget import examples

from fedloom.privacy._hadamard import (
    padded_length,
    rotate,
    rotation_signs,
    unrotate,
    walsh_hadamard,
)

SIZES = [1, 2, 3, 4, 5, 7, 8, 100, 1000, 1023, 1024, 1025, 2**20]


@pytest.mark.parametrize(
    ("d", "expected"), [(1, 1), (2, 2), (3, 4), (5, 8), (1024, 1024), (1025, 2048)]
)
def test_padded_length_is_the_next_power_of_two(d: int, expected: int) -> None:
    assert padded_length(d) == expected


def test_padded_length_refuses_an_empty_vector() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        padded_length(0)


def _sylvester_hadamard(n: int) -> np.ndarray:
    """The dense Walsh-Hadamard matrix by Sylvester's construction H_2n = [[H, H], [H, -H]]."""
    matrix = np.ones((1, 1))
    while matrix.shape[0] < n:
        matrix = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), matrix)
    return matrix


# Up to 16 the transform is one matrix product with H_n; beyond, H_16 factors along
# middle axes follow (256, 4096: two and three factors), and one smaller factor last
# when log2(n) is not a multiple of 4 (32, 64, 128, 512, 1024, 2048).
@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096])
def test_rotation_equals_the_dense_matrix(n: int) -> None:
    # Independent oracle: the dense matrix product H D x / sqrt(n), no butterflies.
    signs = rotation_signs(b"dense", n)
    x = np.random.default_rng(n).normal(size=max(1, n - 1))
    padded = np.zeros(n)
    padded[: x.size] = x
    expected = _sylvester_hadamard(n) @ (signs * padded) / np.sqrt(n)
    np.testing.assert_allclose(rotate(x, signs), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [64, 128, 256, 2048])
def test_the_transform_keeps_float32_and_matches_float64(n: int) -> None:
    x = np.random.default_rng(n).normal(size=n)
    exact = walsh_hadamard(x)
    single = walsh_hadamard(x.astype(np.float32))
    assert single.dtype == np.float32
    np.testing.assert_allclose(single, exact, rtol=0, atol=1e-5 * np.abs(exact).max())


@pytest.mark.parametrize("d", SIZES)
def test_unrotate_inverts_rotate_exactly(d: int) -> None:
    x = np.random.default_rng(d).normal(size=d)
    signs = rotation_signs(b"invert", padded_length(d))
    back = unrotate(rotate(x, signs), signs, d)
    assert back.shape == (d,)
    assert np.linalg.norm(back - x) <= 1e-12 * np.linalg.norm(x)


@pytest.mark.parametrize("d", SIZES)
def test_rotation_keeps_the_norm(d: int) -> None:
    x = np.random.default_rng(d + 1).standard_cauchy(size=d)  # heavy tails, uneven
    y = rotate(x, rotation_signs(b"norm", padded_length(d)))
    assert abs(np.linalg.norm(y) - np.linalg.norm(x)) <= 1e-12 * np.linalg.norm(x)


@settings(max_examples=examples(40), deadline=None)
@given(d=st.integers(1, 3000), seed=st.binary(min_size=0, max_size=40),
       data_seed=st.integers(0, 2**32 - 1))
def test_round_trip_and_norm_for_any_size_and_seed(d: int, seed: bytes, data_seed: int) -> None:
    x = np.random.default_rng(data_seed).normal(size=d) * 10.0 ** np.random.default_rng(
        data_seed).uniform(-3, 3)
    signs = rotation_signs(seed, padded_length(d))
    y = rotate(x, signs)
    assert abs(np.linalg.norm(y) - np.linalg.norm(x)) <= 1e-12 * np.linalg.norm(x)
    assert np.linalg.norm(unrotate(y, signs, d) - x) <= 1e-12 * np.linalg.norm(x)


def test_rotate_accepts_float32_and_leaves_its_input_alone() -> None:
    x = np.arange(5, dtype=np.float32)
    before = x.copy()
    y = rotate(x, rotation_signs(b"f32", 8))
    assert y.dtype == np.float64
    np.testing.assert_array_equal(x, before)


def test_signs_are_deterministic_for_a_seed_and_differ_between_seeds() -> None:
    a = rotation_signs(b"round-1", 4096)
    assert set(np.unique(a)) == {-1.0, 1.0}
    np.testing.assert_array_equal(a, rotation_signs(b"round-1", 4096))
    b = rotation_signs(b"round-2", 4096)
    # Independent fair signs agree on about half the coordinates (sd 32 of 4096).
    assert 1700 < int(np.sum(a == b)) < 2400
    x = np.random.default_rng(0).normal(size=3000)
    assert not np.allclose(rotate(x, a), rotate(x, b))


def test_signs_are_balanced() -> None:
    signs = rotation_signs(b"balance", 2**16)
    # Mean of 65536 fair ±1 has standard deviation 1/256; 6 of them.
    assert abs(float(signs.mean())) < 6.0 / 256


def test_signs_need_a_power_of_two_length() -> None:
    with pytest.raises(ValueError, match="power of two"):
        rotation_signs(b"x", 12)


@pytest.mark.parametrize("n", [1, 2, 1024, 2**16])
def test_rotation_spreads_a_one_hot_vector_evenly(n: int) -> None:
    # U e_j is the j-th column of H D / sqrt(n): every entry is ±1/sqrt(n).
    signs = rotation_signs(b"spread", n)
    for j in {0, n // 3, n - 1}:
        one_hot = np.zeros(n)
        one_hot[j] = 1.0
        np.testing.assert_allclose(np.abs(rotate(one_hot, signs)), 1.0 / np.sqrt(n), rtol=1e-12)


def test_rotate_refuses_a_vector_longer_than_the_signs() -> None:
    with pytest.raises(ValueError, match="at most 4"):
        rotate(np.ones(5), rotation_signs(b"x", 4))
    with pytest.raises(ValueError, match="original dimension"):
        unrotate(np.ones(4), rotation_signs(b"x", 4), 5)


def test_a_million_coordinates_rotate_well_under_a_second() -> None:
    n = 2**20
    signs = rotation_signs(b"fast", n)
    x = np.random.default_rng(1).normal(size=n - 5)
    best = np.inf
    for _ in range(2):
        start = time.perf_counter()
        unrotate(rotate(x, signs), signs, n - 5)
        best = min(best, time.perf_counter() - start)
    assert best < 1.0, f"rotate + unrotate of 2**20 took {best:.2f} s"
