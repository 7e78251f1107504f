"""What the Skellam tests share: clipping, the server's modular sum, and updates of
spread norms."""

from __future__ import annotations

import numpy as np


def clipped(x: np.ndarray, c: float) -> np.ndarray:
    norm = np.linalg.norm(x)
    return x * (c / norm) if norm > c else x


def modular_sum(parts: list[np.ndarray]) -> np.ndarray:
    """What secure aggregation hands the server: the sum in Z_{2^32} as uint32."""
    return np.asarray(np.sum(np.stack(parts), axis=0, dtype=np.uint32))


def spread_updates(n: int, d: int, c: float, seed: int) -> np.ndarray:
    """Updates with norms from c/4 to 4c, so some are clipped and some not."""
    rng = np.random.default_rng(seed)
    raw = rng.normal(size=(n, d))
    norms = np.linspace(0.25, 4.0, n) * c
    return raw * (norms / np.linalg.norm(raw, axis=1))[:, None]
