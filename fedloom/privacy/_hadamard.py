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

import functools
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
    signs = np.unpackbits(np.frombuffer(stream, dtype=np.uint8))[:length].astype(np.float64)
    signs *= -2.0  # in place: a client computes 2**20 of these every round
    signs += 1.0
    return signs


#: The order of the dense Hadamard factors the transform is applied with (below).
#: Small enough that a factor's matrix product costs little more than a pass over
#: memory, large enough that there are few passes (5 for 2**20 values).
_FACTOR = 16


@functools.lru_cache(maxsize=8)
def _dense_hadamard(order: int, dtype: str) -> np.ndarray:
    """Sylvester's ``H_order`` (entries ±1, exact in any float dtype), read-only."""
    matrix = np.ones((1, 1), dtype=dtype)
    while matrix.shape[0] < order:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    matrix.setflags(write=False)
    return matrix


def walsh_hadamard(values: np.ndarray) -> np.ndarray:
    """The (unnormalized) Walsh-Hadamard transform of ``values``, as a new array.

    ``values``: 1-D float32 or float64 of a power-of-two length; the result has its
    dtype. ``H_n`` is the Kronecker product ``H_a ⊗ H_b ⊗ ...`` of smaller Hadamard
    matrices (``n = a b ...``), so the vector is viewed as a tensor with one axis per
    factor and each factor is applied along its axis as one (batched) matrix product
    with the dense ``H_16`` (``H_a`` for the one smaller factor when log2(n) is not a
    multiple of 4). O(16 n log16 n) arithmetic in BLAS, with one pass over memory per
    factor: about twice as fast as radix-4 butterflies in numpy for float32.
    """
    n = values.shape[0]
    levels = n.bit_length() - 1
    out, inner = values, 1  # `inner`: the product of the factors applied so far
    while inner < n:
        order = 1 << min(levels, _FACTOR.bit_length() - 1)
        levels -= order.bit_length() - 1
        factor = _dense_hadamard(order, values.dtype.str)
        if inner == 1:  # the last axis: contiguous rows times H (H is symmetric)
            out = (out.reshape(-1, order) @ factor).reshape(-1)
        else:  # a middle axis: H times each (order, inner) slice
            out = np.matmul(factor, out.reshape(-1, order, inner)).reshape(-1)
        inner *= order
    return out if out is not values else values.copy()


def rotate(x: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """``H D x / sqrt(n)`` with ``x`` zero-padded to ``n = len(signs)``; float64.

    ``x`` (one-dimensional, at most ``n`` long, any real dtype) is not modified.
    """
    values = np.asarray(x)
    n = signs.shape[0]
    if values.ndim != 1 or values.shape[0] > n:
        raise ValueError(f"rotate needs a 1-D vector of at most {n} values, got {values.shape}")
    padded = np.zeros(n)
    np.multiply(values, signs[: values.shape[0]], out=padded[: values.shape[0]])
    out = walsh_hadamard(padded)
    out *= 1.0 / np.sqrt(n)
    return out


def unrotate(y: np.ndarray, signs: np.ndarray, d: int) -> np.ndarray:
    """Invert `rotate`: ``D H y / sqrt(n)``, truncated to the first ``d`` values; float64."""
    values = np.asarray(y)
    n = signs.shape[0]
    if values.shape != (n,):
        raise ValueError(f"unrotate needs a vector of {n} values, got {values.shape}")
    if not 1 <= d <= n:
        raise ValueError(f"the original dimension must be in [1, {n}], got {d}")
    out = walsh_hadamard(values.astype(np.float64, copy=False))
    out *= signs
    out *= 1.0 / np.sqrt(n)
    return out if d == n else out[:d].copy()
