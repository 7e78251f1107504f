"""Shamir t-of-k secret sharing of 32-byte secrets over the prime field GF(2**521 - 1).

Shamir, "How to share a secret", CACM 1979. A secret ``s`` (32 bytes, read as a
big-endian integer below 2**256) is the constant term of a random polynomial of degree
``t - 1``; the share for x-coordinate ``x`` is ``f(x)``. Any ``t`` shares give ``s`` by
Lagrange interpolation at 0; any ``t - 1`` shares are consistent with every secret
(perfect secrecy), so they reveal nothing.

Why this and not PyCryptodome's ``Crypto.Protocol.SecretSharing.Shamir`` (the vetted
library Flower uses): it shares 16-byte secrets over GF(2**128), so a 32-byte key takes
two independent sharings, its ``combine`` costs about 5 ms per 16-byte chunk here (field
inversions by exponentiation in pure Python) and it would add a native dependency to the
edge client's base install, which is numpy, grpcio, protobuf and cryptography. Python's
integers give the prime-field arithmetic directly (``pow(x, -1, p)`` is the inverse),
so the whole scheme is the twenty lines below, reviewed against the paper and tested
(every threshold-sized subset reconstructs; fewer shares are consistent with any secret).

The field is GF(p) with the Mersenne prime p = 2**521 - 1 (the field of NIST P-521), so
one element holds a whole 256-bit secret and a share is 66 bytes. A reconstruction from
too few shares, or with a share of another sharing, yields a value uniform in GF(p),
which is below 2**256 with probability 2**-265: such a value is refused. A share that
was altered by a small amount is NOT caught by this range check (small x-coordinates
have small integer Lagrange coefficients, so the result moves by a small amount); the
server therefore checks every reconstructed secret against what the owner advertised
(a commitment to its self-mask seed, the public key of its mask key).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from fedloom.errors import SecureAggregationError

PRIME = (1 << 521) - 1
SHARE_BYTES = 66  # ceil(521 / 8)
SECRET_BYTES = 32


def _evaluate(coefficients: Sequence[int], x: int) -> int:
    """Horner's rule: ``sum(c_i * x**i) mod p``."""
    value = 0
    for c in reversed(coefficients):
        value = (value * x + c) % PRIME
    return value


def split(secret: bytes, threshold: int, xs: Sequence[int]) -> list[bytes]:
    """Share ``secret`` so that any ``threshold`` of the returned shares recover it.

    Args:
        secret: 32 bytes.
        threshold: t >= 1 (a degree ``t - 1`` polynomial).
        xs: distinct non-zero x-coordinates, one per share (at least ``threshold``).

    Returns:
        The share values ``f(x)`` for each ``x`` in ``xs``, 66 bytes each, big-endian.
    """
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a shared secret must be {SECRET_BYTES} bytes")
    if threshold < 1 or len(xs) < threshold:
        raise ValueError(f"need at least threshold ({threshold}) x-coordinates, got {len(xs)}")
    if len(set(xs)) != len(xs) or any(not 0 < x < PRIME for x in xs):
        raise ValueError("x-coordinates must be distinct and in 1..p-1")
    coefficients = [int.from_bytes(secret, "big")]
    coefficients += [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    return [_evaluate(coefficients, x).to_bytes(SHARE_BYTES, "big") for x in xs]


def decode_share(value: bytes) -> int:
    """A share's y value as a field element; refuses malformed bytes."""
    if len(value) != SHARE_BYTES:
        raise SecureAggregationError(f"a share must be {SHARE_BYTES} bytes, got {len(value)}")
    y = int.from_bytes(value, "big")
    if y >= PRIME:
        raise SecureAggregationError("a share is not a field element (>= p)")
    return y


def interpolate_at_zero(points: Sequence[tuple[int, int]]) -> int:
    """Lagrange interpolation of the polynomial through ``points`` evaluated at 0."""
    xs = [x for x, _ in points]
    if len(set(xs)) != len(xs):
        raise SecureAggregationError("two shares have the same x-coordinate")
    total = 0
    for i, (xi, yi) in enumerate(points):
        numerator, denominator = 1, 1
        for j, xj in enumerate(xs):
            if j != i:
                numerator = numerator * xj % PRIME
                denominator = denominator * (xj - xi) % PRIME
        total = (total + yi * numerator * pow(denominator, -1, PRIME)) % PRIME
    return total


def reconstruct(shares: Sequence[tuple[int, bytes]], threshold: int) -> bytes:
    """Recover the secret from ``(x, share)`` pairs; uses the first ``threshold``.

    Raises:
        SecureAggregationError: fewer than ``threshold`` shares, duplicate
            x-coordinates, malformed shares, or a result that is not a 256-bit secret
            (wrong shares, or shares of a polynomial of higher degree).
    """
    if len(shares) < threshold:
        raise SecureAggregationError(
            f"{len(shares)} shares cannot reconstruct a secret shared with threshold {threshold}"
        )
    points = [(x, decode_share(value)) for x, value in shares[:threshold]]
    secret = interpolate_at_zero(points)
    if secret >= 1 << (8 * SECRET_BYTES):
        raise SecureAggregationError("the shares are inconsistent (wrong or too few shares)")
    return secret.to_bytes(SECRET_BYTES, "big")
