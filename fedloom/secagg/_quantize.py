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

from collections.abc import Sequence

import numpy as np

from fedloom.errors import SecureAggregationError
from fedloom.weights import TensorSpec, Weights


def quantize(vector: np.ndarray, weight: float, clip_range: float, bits: int,
             rng: np.random.Generator) -> np.ndarray:
    """Clip, weight and quantize ``vector``; returns uint32 of ``len(vector) + 1``.

    The last element is the quantized weight. ``vector`` is not modified.
    """
    if not 0.0 < weight <= 1.0:
        raise SecureAggregationError(f"a masked weight must be in (0, 1], got {weight}")
    values = np.asarray(vector)
    if values.ndim != 1:
        raise SecureAggregationError("the vector to quantize must be one-dimensional")
    if not np.isfinite(values).all():
        raise SecureAggregationError("the update holds non-finite values (NaN or inf)")
    levels = float((1 << bits) - 1)
    n = values.shape[0]
    # (w * z + c) * L / (2c) = z * (w * L / (2c)) + L / 2, then + U and floor
    scaled = np.empty(n + 1, dtype=np.float64)
    noise = rng.random(n + 1)
    body = scaled[:n]
    np.clip(values, -clip_range, clip_range, out=body)
    body *= weight * levels / (2.0 * clip_range)
    body += levels / 2.0
    scaled[n] = weight * levels
    scaled += noise
    np.floor(scaled, out=scaled)
    np.minimum(scaled, levels, out=scaled)  # float rounding at the top edge
    return scaled.astype(np.uint32)


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


def flatten(weights: Weights) -> np.ndarray:
    """All tensors of ``weights`` concatenated in order, as one float64 vector."""
    parts = [np.asarray(a, dtype=np.float64).reshape(-1) for a in weights.values()]
    return np.concatenate(parts) if parts else np.zeros(0, np.float64)


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
