"""Aggregation of per-client metrics: numeric values averaged, weighted by examples."""

from __future__ import annotations

from collections.abc import Iterable

from fedloom.types import Metrics


def weighted_metric_means(records: Iterable[tuple[int, Metrics]]) -> dict[str, float]:
    """Weighted mean of every numeric (non-bool) metric over the records that have it."""
    sums: dict[str, float] = {}
    weights: dict[str, int] = {}
    for num_examples, metrics in records:
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            sums[key] = sums.get(key, 0.0) + float(value) * num_examples
            weights[key] = weights.get(key, 0) + num_examples
    return {key: sums[key] / weights[key] for key in sums}
