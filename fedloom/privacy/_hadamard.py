"""The randomized Hadamard rotation that flattens a vector before discretization.

The distributed Skellam and discrete Gaussian mechanisms round every coordinate to
an integer and sum modulo ``2**bits``. A vector whose energy sits in a few
coordinates would need a wide range for those and wastes it on the rest; rotating
with ``U = H D / sqrt(n)`` (``H`` the Walsh-Hadamard matrix, ``D`` a random ±1
diagonal) spreads any vector evenly, so each coordinate of the rotated vector is
about ``||x|| / sqrt(n)`` in size (Agarwal, Kairouz & Liu, NeurIPS 2021, section 4;
Kairouz, Liu & Steinke, ICML 2021, section 4.2). ``U`` is orthonormal, so the L2
norm is kept exactly (to float64 rounding) and the server inverts it after the sum:
``U^-1 = D H / sqrt(n)`` because ``H H = n I``.

``D`` is public: every client and the server derive it from a shared round seed.
It is expanded with SHAKE-256 rather than a numpy generator so that clients and
server on different numpy versions always agree (numpy promises stable bit
generators, not stable ``Generator`` methods).

Example::

    >>> import numpy as np
    >>> signs = rotation_signs(b"round-7", padded_length(3))
    >>> y = rotate(np.array([3.0, 0.0, 4.0]), signs)
    >>> round(float(np.linalg.norm(y)), 12), np.allclose(unrotate(y, signs, 3), [3, 0, 4])
    (5.0, True)
"""

from __future__ import annotations

import hashlib

import numpy as np

#: Domain separation, so the sign stream never equals another use of the same seed.
_SIGN_DOMAIN = b"fedloom/privacy/hadamard-signs/v1\x00"


def padded_length(d: int) -> int:
    """The smallest power of two that is at least ``d`` (``d >= 1``)."""
    if d < 1:
        raise ValueError(f"the dimension must be at least 1, got {d}")
    return 1 << (d - 1).bit_length()


def rotation_signs(seed: bytes, length: int) -> np.ndarray:
    """The random ±1 diagonal ``D`` of ``length`` (a power of two), from a public seed.

    Deterministic: the same ``seed`` and ``length`` give the same float64 array of
    +1.0 and -1.0 on every machine. One SHAKE-256 output bit per sign.
    """
    if length < 1 or length & (length - 1):
        raise ValueError(f"the rotation length must be a power of two, got {length}")
    stream = hashlib.shake_256(_SIGN_DOMAIN + bytes(seed)).digest((length + 7) // 8)
    bits = np.unpackbits(np.frombuffer(stream, dtype=np.uint8))[:length]
    return 1.0 - 2.0 * bits.astype(np.float64)


def _walsh_hadamard_inplace(values: np.ndarray) -> None:
    """Apply the (unnormalized) Walsh-Hadamard transform to ``values`` in place.

    One vectorized butterfly per level: viewing the array as blocks ``(a, b)`` of
    width ``h`` gives ``(a + b, a - b)``; ``log2(n)`` levels, O(n log n) in all.
    """
    n = values.shape[0]
    half = 1
    scratch = np.empty(n // 2, dtype=values.dtype)
    while half < n:
        blocks = values.reshape(-1, 2, half)
        first, second = blocks[:, 0, :], blocks[:, 1, :]
        saved = scratch.reshape(-1, half)
        np.copyto(saved, first)
        first += second  # a + b
        np.subtract(saved, second, out=second)  # a - b
        half *= 2


def rotate(x: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """``H D x / sqrt(n)`` with ``x`` zero-padded to ``n = len(signs)``; float64.

    ``x`` (one-dimensional, at most ``n`` long, any real dtype) is not modified.
    """
    values = np.asarray(x)
    n = signs.shape[0]
    if values.ndim != 1 or values.shape[0] > n:
        raise ValueError(f"rotate needs a 1-D vector of at most {n} values, got {values.shape}")
    out = np.zeros(n, dtype=np.float64)
    np.multiply(values, signs[: values.shape[0]], out=out[: values.shape[0]])
    _walsh_hadamard_inplace(out)
    out *= 1.0 / np.sqrt(n)
    return out


def unrotate(y: np.ndarray, signs: np.ndarray, d: int) -> np.ndarray:
    """Invert `rotate`: ``D H y / sqrt(n)``, truncated to the first ``d`` values."""
    values = np.asarray(y)
    n = signs.shape[0]
    if values.shape != (n,):
        raise ValueError(f"unrotate needs a vector of {n} values, got {values.shape}")
    if not 1 <= d <= n:
        raise ValueError(f"the original dimension must be in [1, {n}], got {d}")
    out = values.astype(np.float64, copy=True)
    _walsh_hadamard_inplace(out)
    out *= signs
    out *= 1.0 / np.sqrt(n)
    return out if d == n else out[:d].copy()
