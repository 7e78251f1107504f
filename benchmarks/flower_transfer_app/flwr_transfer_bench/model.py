"""The benchmark model: the same layout fedloom's side of the benchmark moves."""

from __future__ import annotations

import numpy as np

BIAS = 10


def initial_arrays(num_params: int) -> list[np.ndarray]:
    """A flat weight and a small bias (float32), together ``num_params`` values."""
    bias = min(BIAS, num_params // 2)
    return [
        np.full(num_params - bias, 0.01, dtype=np.float32),
        np.full(bias, 0.01, dtype=np.float32),
    ]
