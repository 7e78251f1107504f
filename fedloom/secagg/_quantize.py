"""Fixed-point quantization into Z_{2^32} with stochastic rounding, and its inverse.

A client contributes ``w * clip(delta)`` and ``w`` itself, with the weight
``w = num_examples / max_weight`` in (0, 1]. With ``c = clip_range`` and
``L = 2**bits - 1`` levels, a coordinate ``z`` in [-c, c] maps to
``floor((z + c) * L / (2c) + U)`` with ``U ~ Uniform[0, 1)`` (stochastic rounding:
unbiased, and off by less than one quantum ``2c / L``), and the weight to
``floor(w * L + U)``. Every value is at most ``L < 2**bits``, so the sum of
``n <= 2**(32 - bits)`` of them does not wrap modulo 2**32 and decodes exactly:
``sum z = S * 2c / L - n * c`` and ``sum w = S_w / L``, each within ``n`` quanta.
(Bonawitz et al., CCS 2017, section 3; stochastic rounding as in Suresh et al.,
ICML 2017.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedloom.errors import SecureAggregationError
from fedloom.secagg._prg import keystream_words
from fedloom.secagg._setup import SEED_BYTES
from fedloom.weights import TensorSpec, Weights, clip_to_norm

#: Values quantized per block (256 KiB of float64 scratch: the passes stay in cache;
#: 32K measured 5-10% faster than 16K or 64K at 1M values).
_BLOCK = 1 << 15
_WORD = 2.0**-32


def quantize(vector: np.ndarray, weight: float, clip_range: float, bits: int,
             rng: np.random.Generator) -> np.ndarray:
    """Clip, weight and quantize ``vector``; returns uint32 of ``len(vector) + 1``.

    The last element is the quantized weight. ``vector`` (any float dtype) is not
    modified. The rounding noise is ``U = ((word + 2**31) mod 2**32) / 2**32`` for
    successive words of the mask PRG (`keystream_words`, AES-128-CTR) keyed by 32 bytes
    drawn from ``rng``: uniform on [0, 1) to 2**-32, so the rounding is unbiased to
    2**-32 of a quantum, and three times cheaper to draw than numpy's doubles. (The
    word is read as a signed int32 ``s`` and ``U = s / 2**32 + 1/2``, the half folded into
    the offset: numpy converts int32 to float64 and back faster than uint32.) Works
    block by block, in cache.
    """
    if not 0.0 < weight <= 1.0:
        raise SecureAggregationError(f"a masked weight must be in (0, 1], got {weight}")
    values = np.asarray(vector)
    if values.ndim != 1:
        raise SecureAggregationError("the vector to quantize must be one-dimensional")
    levels = float((1 << bits) - 1)
    n = values.shape[0]
    out = np.empty(n + 1, dtype=np.uint32)
    # Values reach L + 1 at most (float rounding at the top edge, clamped below): below
    # 2**31 when bits <= 30, so the faster cast to int32 can fill the output.
    target = out.view(np.int32) if bits <= 30 else out
    # (w * z + c) * L / (2c) = z * (w * L / (2c)) + L / 2, then + U and floor; the sum
    # is >= 0 (w <= 1, U >= 0), so the cast (truncation) is the floor.
    scale, offset = weight * levels / (2.0 * clip_range), levels / 2.0 + 0.5
    top = np.uint32((1 << bits) - 1)
    scratch, noise = np.empty(min(n + 1, _BLOCK)), np.empty(min(n + 1, _BLOCK))
    words = keystream_words(rng.bytes(SEED_BYTES), n + 1, _BLOCK)
    for a, word in zip(range(0, n + 1, _BLOCK), words, strict=True):
        b = min(n + 1, a + _BLOCK)
        body, part = scratch[: b - a], values[a : min(b, n)]
        k = part.shape[0]
        if not np.isfinite(part).all():
            raise SecureAggregationError("the update holds non-finite values (NaN or inf)")
        np.clip(part, -clip_range, clip_range, out=body[:k])
        body[:k] *= scale
        body[:k] += offset
        if k < b - a:
            body[k] = weight * levels + 0.5  # the weight, last
        np.multiply(word.view(np.int32), _WORD, out=noise[: b - a])  # U - 1/2
        body += noise[: b - a]
        np.copyto(target[a:b], body, casting="unsafe")
        np.minimum(out[a:b], top, out=out[a:b])  # float rounding at the top edge
    return out


def dequantize(total: np.ndarray, count: int, clip_range: float,
               bits: int) -> tuple[np.ndarray, float]:
    """Decode the modular sum of ``count`` quantized vectors.

    Returns:
        ``(sum of w * clip(delta), sum of w)`` as float64 (vector) and float.
    """
    levels = float((1 << bits) - 1)
    if total.dtype != np.uint32 or total.ndim != 1 or total.shape[0] < 2:
        raise SecureAggregationError("a quantized sum is a uint32 vector of length >= 2")
    if count < 1 or (count - 1).bit_length() + bits > 32:
        raise SecureAggregationError(f"{count} quantized values at {bits} bits could wrap")
    weighted = total[:-1].astype(np.float64)
    weighted *= 2.0 * clip_range / levels
    weighted -= count * clip_range
    return weighted, float(total[-1]) / levels


def flatten(weights: Weights, dtype: np.dtype[Any] | type | None = np.float64) -> np.ndarray:
    """All tensors of ``weights`` concatenated in order, as one vector.

    ``dtype`` float64 by default; ``None`` keeps the tensors' common dtype (no copy of a
    single one-dimensional tensor): `quantize` takes any float dtype, so a client need not
    widen a float32 update to float64 first.
    """
    arrays = [np.asarray(a).reshape(-1) for a in weights.values()]
    if not arrays:
        return np.zeros(0, np.float64 if dtype is None else dtype)
    target = np.result_type(*arrays) if dtype is None else np.dtype(dtype)
    if len(arrays) == 1:
        return arrays[0].astype(target, copy=False)
    return np.concatenate(arrays, dtype=target)


def unflatten(vector: np.ndarray, specs: Sequence[TensorSpec]) -> Weights:
    """Split a flat float64 vector back into tensors of ``specs``' shapes (float64).

    The values stay float64 (mean deltas); integer tensors are cast back by the
    aggregator's rule (round half to even) when the delta is applied.
    """
    total = sum(s.size for s in specs)
    if vector.shape != (total,):
        raise SecureAggregationError(f"a flat vector of {total} values was expected")
    out, pos = [], 0
    for spec in specs:
        out.append((spec.name, vector[pos : pos + spec.size].reshape(spec.shape)))
        pos += spec.size
    return Weights(out)


def clip_delta(delta: Weights, max_norm: float) -> Weights:
    """Scale the floating tensors of ``delta`` so their global L2 norm is <= ``max_norm``.

    The client-side form of the server's norm bound: `fedloom.weights.clip_to_norm`
    (integer tensors are neither counted nor scaled), with the scaled tensors left in
    float64, as `quantize` reads them (one rounding, not two). A bound that is not a
    positive finite number raises `SecureAggregationError`: the client refuses the round.
    """
    if not (math.isfinite(max_norm) and max_norm > 0):
        raise SecureAggregationError(f"max_update_norm must be a positive number, got {max_norm}")
    return clip_to_norm(delta, max_norm, keep_dtype=False).weights
