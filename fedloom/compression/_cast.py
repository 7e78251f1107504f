"""Lossy casts: fp16 and bf16, for updates and for the broadcast.

- ``fp16``: IEEE half precision (numpy's cast, round to nearest even). 11 significant
  bits: a value's error is at most ``2**-11`` of it (``2**-25`` absolute below the
  normal range); values beyond ``±65504`` cannot be sent and are refused.
- ``bf16``: bfloat16, float32's exponent with 8 significant bits (round to nearest
  even on the float32 bits): error at most ``2**-8`` of the value (``2**-134``
  absolute for float32's subnormals), float32's whole range. Carried as uint16
  (numpy has no bfloat16).

float16 tensors already are what fp16 sends and travel as they are; float64 tensors
are cast (bf16 goes through float32 first).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedloom.compression._base import Codec, CompressionError, part_name
from fedloom.weights import TensorSpec

FP16_MAX = float(np.finfo(np.float16).max)


class Fp16Codec(Codec):
    """IEEE half precision."""

    name = "fp16"

    def applies(self, spec: TensorSpec) -> bool:
        return spec.dtype in ("float32", "float64")

    def part_specs(self, spec: TensorSpec) -> tuple[TensorSpec, ...]:
        return (TensorSpec(part_name(spec.name, "f16"), "float16", spec.shape),)

    def encode_tensor(self, flat: np.ndarray, spec: TensorSpec,
                      rng: np.random.Generator) -> tuple[np.ndarray, ...]:
        if flat.size and not np.isfinite(flat).all():
            raise CompressionError(f"tensor {spec.name!r} holds non-finite values")
        if flat.size and float(np.max(np.abs(flat))) > FP16_MAX:
            raise CompressionError(
                f"tensor {spec.name!r} holds values beyond float16's range (±{FP16_MAX:g}); "
                "use the bf16 codec, which keeps float32's range")
        return (flat.astype(np.float16),)

    def decode_tensor(self, parts: Sequence[np.ndarray], spec: TensorSpec) -> np.ndarray:
        (half,) = parts
        if not np.isfinite(half).all():
            raise CompressionError(f"part of {spec.name!r} holds non-finite values")
        return half.astype(spec.numpy_dtype)

    def check_tensor(self, parts: Sequence[np.ndarray], spec: TensorSpec) -> None:
        (half,) = parts  # widening a finite half (to float32 or float64) stays finite
        if not np.isfinite(half).all():
            raise CompressionError(f"part of {spec.name!r} holds non-finite values")


class Bf16Codec(Codec):
    """bfloat16, carried as the upper 16 bits of float32 (round to nearest even)."""

    name = "bf16"

    def part_specs(self, spec: TensorSpec) -> tuple[TensorSpec, ...]:
        return (TensorSpec(part_name(spec.name, "bf16"), "uint16", spec.shape),)

    def encode_tensor(self, flat: np.ndarray, spec: TensorSpec,
                      rng: np.random.Generator) -> tuple[np.ndarray, ...]:
        single = np.ascontiguousarray(flat, dtype=np.float32)
        if single.size and not np.isfinite(single).all():
            raise CompressionError(f"tensor {spec.name!r} holds non-finite values "
                                   "(or values beyond float32's range)")
        bits = single.view(np.uint32)
        # Round to nearest, ties to even, on the 16 bits dropped.
        rounding = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
        upper = ((bits + rounding) >> np.uint32(16)).astype(np.uint16)
        if upper.size and not np.isfinite(_widen(upper)).all():
            raise CompressionError(
                f"tensor {spec.name!r} holds values that round beyond bfloat16's range")
        return (upper,)

    def decode_tensor(self, parts: Sequence[np.ndarray], spec: TensorSpec) -> np.ndarray:
        (upper,) = parts
        values = _widen(upper)
        if not np.isfinite(values).all():
            raise CompressionError(f"part of {spec.name!r} holds non-finite values")
        return values.astype(spec.numpy_dtype, copy=False)

    def check_tensor(self, parts: Sequence[np.ndarray], spec: TensorSpec) -> None:
        if spec.dtype == "float16":  # narrowing may overflow: decode and look
            super().check_tensor(parts, spec)
            return
        (upper,) = parts
        # A bfloat16 is non-finite exactly when its 8 exponent bits are all ones.
        exponent = np.uint16(0x7F80)
        if upper.size and ((upper & exponent) == exponent).any():
            raise CompressionError(f"part of {spec.name!r} holds non-finite values")


def _widen(upper: np.ndarray) -> np.ndarray:
    return (upper.astype(np.uint32) << np.uint32(16)).view(np.float32)
