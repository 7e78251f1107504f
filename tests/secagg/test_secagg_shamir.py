"""Shamir t-of-k over GF(2**521 - 1): every threshold subset, below threshold, secrecy."""

from __future__ import annotations

import itertools
import os

import pytest

from fedloom.errors import SecureAggregationError
from fedloom.secagg import PRIME, SHARE_BYTES, reconstruct, split
from fedloom.secagg._shamir import decode_share, interpolate_at_zero

K, T = 10, 6


def test_prime_is_the_mersenne_prime_m521() -> None:
    assert PRIME == 2**521 - 1
    # Fermat test with several bases (M521 is a known Mersenne prime; this guards typos)
    assert all(pow(a, PRIME - 1, PRIME) == 1 for a in (2, 3, 5, 7, 11, 13))
    assert SHARE_BYTES * 8 >= 521


def _solve_mod_p(points: list[tuple[int, int]]) -> list[int]:
    """Independent reference: the polynomial's coefficients by Gaussian elimination
    on the Vandermonde system mod p (not Lagrange's formula)."""
    n = len(points)
    rows = [[pow(x, j, PRIME) for j in range(n)] + [y] for x, y in points]
    for col in range(n):
        pivot = next(r for r in range(col, n) if rows[r][col])
        rows[col], rows[pivot] = rows[pivot], rows[col]
        inv = pow(rows[col][col], -1, PRIME)
        rows[col] = [v * inv % PRIME for v in rows[col]]
        for r in range(n):
            if r != col and rows[r][col]:
                f = rows[r][col]
                rows[r] = [(a - f * b) % PRIME for a, b in zip(rows[r], rows[col], strict=True)]
    return [rows[i][n] for i in range(n)]


def test_shares_lie_on_one_degree_t_minus_1_polynomial_with_the_secret_at_zero() -> None:
    secret = os.urandom(32)
    xs = list(range(1, K + 1))
    ys = [int.from_bytes(s, "big") for s in split(secret, T, xs)]
    coefficients = _solve_mod_p(list(zip(xs[:T], ys[:T], strict=True)))
    assert coefficients[0] == int.from_bytes(secret, "big")
    for x, y in zip(xs[T:], ys[T:], strict=True):  # the other shares are on the same curve
        assert sum(c * pow(x, j, PRIME) for j, c in enumerate(coefficients)) % PRIME == y


def test_every_threshold_subset_reconstructs() -> None:
    secret = os.urandom(32)
    xs = [3, 5, 8, 13, 21, 34, 55, 89, 144, 233]  # arbitrary distinct coordinates
    shares = list(zip(xs, split(secret, T, xs), strict=True))
    subsets = list(itertools.combinations(shares, T))
    assert len(subsets) == 210
    for subset in subsets:
        assert reconstruct(list(subset), T) == secret


def test_below_threshold_fails() -> None:
    secret = os.urandom(32)
    xs = list(range(1, K + 1))
    shares = list(zip(xs, split(secret, T, xs), strict=True))
    for subset in itertools.combinations(shares, T - 1):
        with pytest.raises(SecureAggregationError, match="threshold"):
            reconstruct(list(subset), T)
        # interpolating t-1 shares as if the threshold were t-1 gives a random field
        # element, not the secret (and almost surely not even a 256-bit value)
        with pytest.raises(SecureAggregationError, match="inconsistent"):
            reconstruct(list(subset), T - 1)


def test_t_minus_1_shares_are_consistent_with_every_secret() -> None:
    """Perfect secrecy: for any t-1 shares and ANY candidate secret there is exactly one
    degree t-1 polynomial through both, so the shares do not narrow the secret down."""
    xs = list(range(1, T))
    ys = [decode_share(s) for s in split(os.urandom(32), T, [*xs, T])[: T - 1]]
    for candidate in (0, 1, 2**256 - 1, int.from_bytes(os.urandom(32), "big")):
        coefficients = _solve_mod_p([(0, candidate), *zip(xs, ys, strict=True)])
        assert coefficients[0] == candidate
        for x, y in zip(xs, ys, strict=True):
            assert sum(c * pow(x, j, PRIME) for j, c in enumerate(coefficients)) % PRIME == y


def test_one_share_does_not_depend_on_the_secret() -> None:
    """With t >= 2 a single share is uniform in GF(p) whatever the secret: compare the
    distribution of its low byte for two extreme secrets (chi-square, 255 dof)."""
    for secret in (bytes(32), b"\xff" * 32):
        counts = [0] * 256
        for _ in range(4096):
            counts[split(secret, 2, [1, 2])[0][-1]] += 1
        chi2 = sum((c - 16) ** 2 / 16 for c in counts)
        assert chi2 < 400


def test_share_of_another_sharing_is_detected() -> None:
    secret = os.urandom(32)
    xs = list(range(1, T + 1))
    shares = list(zip(xs, split(secret, T, xs), strict=True))
    shares[2] = (3, split(secret, T, xs)[2])  # same secret, another random polynomial
    with pytest.raises(SecureAggregationError, match="inconsistent"):
        reconstruct(shares, T)


def test_slightly_altered_share_gives_another_secret() -> None:
    """A small change to one share shifts the result by a small multiple (Lagrange
    coefficients of small x are small integers), which the range check cannot see: this
    is why the server checks reconstructed secrets against commitments/public keys."""
    secret = os.urandom(32)
    xs = list(range(1, T + 1))
    shares = list(zip(xs, split(secret, T, xs), strict=True))
    bad = bytearray(shares[2][1])
    bad[-1] ^= 1
    shares[2] = (3, bytes(bad))
    try:
        result = reconstruct(shares, T)
    except SecureAggregationError:
        return  # out of range: caught as well
    assert result != secret


def test_malformed_shares_are_refused() -> None:
    shares = list(zip(range(1, 4), split(bytes(32), 3, [1, 2, 3]), strict=True))
    with pytest.raises(SecureAggregationError, match="same x"):
        interpolate_at_zero([(1, 5), (1, 6)])
    with pytest.raises(SecureAggregationError, match="bytes"):
        reconstruct([(1, b"\x00" * 10), *shares[1:]], 3)
    with pytest.raises(SecureAggregationError, match="field element"):
        reconstruct([(1, b"\xff" * SHARE_BYTES), *shares[1:]], 3)
    with pytest.raises(ValueError):
        split(bytes(32), 3, [1, 1, 2])
    with pytest.raises(ValueError):
        split(bytes(32), 3, [0, 1, 2])
    with pytest.raises(ValueError):
        split(bytes(31), 2, [1, 2])


def test_split_refuses_sharings_whose_shares_would_reveal_the_secret() -> None:
    """With t = 0 the polynomial is the constant secret, and x = p is x = 0 in the field:
    either would hand the secret itself to a holder. Fewer x-coordinates than t could
    never be reconstructed. t = 1 (a constant polynomial) is the documented minimum."""
    secret = os.urandom(32)
    with pytest.raises(ValueError, match="threshold"):
        split(secret, 0, [1, 2, 3])
    with pytest.raises(ValueError, match="threshold"):
        split(secret, 4, [1, 2, 3])
    with pytest.raises(ValueError, match=r"in 1\.\.p-1"):
        split(secret, 3, [1, 2, PRIME])
    assert split(secret, 3, [1, 2, PRIME - 1])  # the largest coordinate is allowed
    (share,) = split(secret, 1, [7])
    assert reconstruct([(7, share)], 1) == secret


@pytest.mark.parametrize("value", [2**256, 2**256 + 1, 2**257 - 1])
def test_a_reconstruction_of_257_bits_or_more_is_refused_as_inconsistent(value: int) -> None:
    """A value at or above 2**256 is no 32-byte secret: the refusal must be the
    `SecureAggregationError` that `reconstruct_checked` passes over to try another subset
    (not an OverflowError that would end the unmasking)."""
    shares = [(x, value.to_bytes(SHARE_BYTES, "big")) for x in (1, 2)]  # a constant f
    with pytest.raises(SecureAggregationError, match="inconsistent"):
        reconstruct(shares, 2)


def test_a_share_equal_to_p_is_not_a_field_element() -> None:
    """Shares are canonical: p itself (0 in the field) is refused like any value >= p."""
    with pytest.raises(SecureAggregationError, match="field element"):
        decode_share(PRIME.to_bytes(SHARE_BYTES, "big"))
    assert decode_share((PRIME - 1).to_bytes(SHARE_BYTES, "big")) == PRIME - 1
