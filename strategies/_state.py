"""Helpers for optimizer state: per-tensor buffers as checkpointable state.

A buffer set (momentum, first or second moments) is a ``dict`` name -> float64 numpy
array, or ``None`` before the first step. In a `StateDict` it stays a ``dict`` of arrays
(arrays are allowed as leaves), so it survives a checkpoint round trip. A checkpoint
writer may turn a 0-d array into a 1-d array of one element; `buffer_for` reshapes
such a buffer back to the tensor's shape (same size), and refuses any other mismatch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedloom.errors import AggregationError

Buffers = dict[str, np.ndarray]


def buffers_to_state(buffers: Mapping[str, np.ndarray] | None) -> Buffers | None:
    """Copy a buffer set into state form (``None`` stays ``None``)."""
    if buffers is None:
        return None
    return {name: np.array(value, dtype=np.float64, copy=True) for name, value in buffers.items()}


def buffers_from_state(value: Any, what: str) -> Buffers | None:
    """Read a buffer set back from a state dict, refusing anything but name -> array."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{what}: expected a mapping of tensor name to array, got {value!r}")
    out: Buffers = {}
    for name, array in value.items():
        if not isinstance(name, str):
            raise ValueError(f"{what}: tensor name {name!r} is not a string")
        arr = np.array(array, dtype=np.float64, copy=True)
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"{what}[{name!r}]: holds non-finite values")
        out[name] = arr
    return out


def buffer_for(
    buffers: Buffers | None, name: str, like: np.ndarray, initial: float, what: str
) -> np.ndarray:
    """The float64 buffer of tensor ``name`` shaped like ``like``; ``initial`` when none yet.

    Raises:
        AggregationError: the buffer set exists but lacks ``name`` or has another size
            (the model's layout changed mid-run; restart the optimizer state).
    """
    if buffers is None:
        return np.full(like.shape, initial, dtype=np.float64)
    buf = buffers.get(name)
    if buf is None:
        raise AggregationError(
            f"{what} has no buffer for tensor {name!r}: the model's layout changed since the "
            "optimizer state was created; start a new run or drop the optimizer state"
        )
    if buf.shape != like.shape:
        if buf.size != like.size:
            raise AggregationError(
                f"{what} buffer for tensor {name!r} has shape {list(buf.shape)}, the tensor "
                f"has {list(like.shape)}: the model's layout changed mid-run"
            )
        buf = buf.reshape(like.shape)
    return buf


def check_buffer_names(buffers: Buffers | None, names: list[str], what: str) -> None:
    """Refuse a buffer set that holds tensors the model no longer has."""
    if buffers is None:
        return
    extra = sorted(set(buffers) - set(names))
    if extra:
        raise AggregationError(
            f"{what} holds buffers for tensors {extra} that the model does not have: the "
            "model's layout changed mid-run"
        )
