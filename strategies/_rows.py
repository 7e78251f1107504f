"""Folding the rows of one `fedloom.stacked.WeightsStack` into running sums at once.

An engine that trains clients together hands the weighted mean a row per client
(`fedloom.stacked.WeightsRow`); folding them one by one costs a few numpy calls per
tensor per client, as much as training a small model. Here a stack's rows fold with
one ``weights @ rows`` per tensor window: products exact in float64 (a float32 value
times an example count), sums in float64, in the order the matrix product takes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from fedloom.stacked import WeightsRow
from fedloom.weights import TensorSpec

#: Elements of the float64 temporary a fold holds at once.
WINDOW = 1 << 16


def fold_rows(rows: Sequence[tuple[WeightsRow, float]], specs: Sequence[TensorSpec],
              sum_of: Callable[[TensorSpec], tuple[np.ndarray, bool]]) -> None:
    """Add ``sum(weight * row)`` over ``rows`` (all of one stack) into each tensor's
    flat float64 sum, as ``sum_of(spec) -> (sum, fresh)`` gives it (a fresh sum is
    written rather than added to)."""
    if not rows:
        return
    stack = rows[0][0].stack
    index = np.fromiter((row.row for row, _ in rows), np.intp, len(rows))
    weights = np.fromiter((weight for _, weight in rows), np.float64, len(rows))
    whole = len(rows) == len(stack) and bool((index == np.arange(len(stack))).all())
    for spec in specs:
        acc, fresh = sum_of(spec)
        array = stack.arrays[spec.name]
        block = (array if whole else array[index]).reshape(len(rows), -1)
        for start, end in windows(acc.size, max(1, WINDOW // len(rows))):
            part = weights @ block[:, start:end].astype(np.float64)
            if fresh:
                acc[start:end] = part
            else:
                acc[start:end] += part


def windows(size: int, width: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of consecutive windows of at most ``width`` over ``size`` elements."""
    for start in range(0, size, width):
        yield start, min(size, start + width)
