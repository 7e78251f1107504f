"""Aggregation of per-client metrics: the default weighted means, or the caller's hooks.

Every strategy takes Flower's two hooks, with Flower 1.42's signature
(``flwr.common.typing.MetricsAggregationFn``)::

    def weighted_accuracy(results: list[tuple[int, dict[str, Scalar]]]) -> dict[str, Scalar]:
        total = sum(n for n, _ in results)
        return {"accuracy": sum(n * m["accuracy"] for n, m in results) / total}

    FedAvg(fit_metrics_aggregation_fn=..., evaluate_metrics_aggregation_fn=weighted_accuracy)

They are called as Flower's ``FedAvg.aggregate_fit`` / ``aggregate_evaluate`` call them:
with ``(num_examples, metrics)`` of every result the round aggregates (a robust rule's
hook sees all of them, not only the updates it selected; an evaluate hook's metrics do
not hold the loss), and only when there is at least one. Where fedloom differs:

- without a hook, numeric metrics are averaged weighted by ``num_examples``
  (`weighted_metric_means`); Flower reports none and warns;
- the strategy's own entries are added after the hook's output and replace a hook entry
  of the same name: fit ``num_updates`` and ``num_examples``, evaluate ``loss`` (the
  weighted mean, as Flower's ``weighted_loss_avg``) and ``num_examples``;
- a fit hook is called only when the round produces a model, and never on a server-made
  mean: under secure aggregation (the server sees no client's fit metrics) and under
  differential privacy (client metrics are functions of the data, outside the guarantee)
  it is not called at all;
- a hook that raises, or returns anything but a mapping of names to bool, int (signed
  64-bit), float (finite) or str, is logged as an error naming the hook and its output
  is dropped for that round (the round's model and the strategy's own entries stand): a
  fault in reporting code does not throw away the clients' training. ``bytes`` values are
  refused because the run store keeps round metrics as JSON; numpy scalars are
  converted to Python numbers.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from fedloom.types import (
    MAX_ENTRIES,
    MAX_KEY_LENGTH,
    Metrics,
    Scalar,
    checked_value,
)

logger = logging.getLogger(__name__)

#: Flower's ``MetricsAggregationFn``: ``(num_examples, metrics)`` pairs -> metrics.
MetricsAggregationFn = Callable[[list[tuple[int, dict[str, Scalar]]]], Mapping[str, Scalar]]

#: The client id of the one update a secure round hands to the strategy (its mean).
SECURE_MEAN_ID = "secure-aggregate"
#: The client id of the noised mean a differentially private round hands to the strategy.
DP_MEAN_ID = "dp-mean"
#: Updates made by the server from many clients: no client's metrics ride on them.
SERVER_MEAN_IDS = frozenset({SECURE_MEAN_ID, DP_MEAN_ID})
#: The most entries a hook may return: a round's metrics hold at most `MAX_ENTRIES`, and
#: the strategy and its wrappers add a few of their own.
MAX_HOOK_ENTRIES = MAX_ENTRIES - 32


def weighted_metric_means(records: Iterable[tuple[int, Metrics]]) -> dict[str, float]:
    """Weighted mean of every numeric (non-bool) metric over the records that have it.

    Clients choose their metrics, so the result is kept within what a round's metrics
    may hold, whatever they send: a mean that overflows (huge values times many
    examples) is formed again as a convex combination, which cannot, and at most
    `MAX_HOOK_ENTRIES` keys are kept, those reported with the most examples (then by
    name); the rest are dropped with a warning.
    """
    records = list(records)
    sums: dict[str, float] = {}
    weights: dict[str, int] = {}
    for num_examples, metrics in records:
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            sums[key] = sums.get(key, 0.0) + float(value) * num_examples
            weights[key] = weights.get(key, 0) + num_examples
    means = {}
    for key, total in sums.items():
        mean = total / weights[key]
        if not math.isfinite(mean):
            mean = math.fsum(float(m[key]) * (n / weights[key]) for n, m in records
                             if isinstance(m.get(key), int | float)
                             and not isinstance(m.get(key), bool))
        if math.isfinite(mean):
            means[key] = mean
    if len(means) > MAX_HOOK_ENTRIES:
        kept = sorted(means, key=lambda k: (-weights[k], k))[:MAX_HOOK_ENTRIES]
        logger.warning("clients reported %d distinct numeric metrics; the %d reported with "
                       "the most examples are averaged, the rest dropped", len(means),
                       MAX_HOOK_ENTRIES)
        means = {key: means[key] for key in kept}
    return means


def aggregate_metrics(
    hook: MetricsAggregationFn | None,
    hook_name: str,
    server_round: int,
    records: list[tuple[int, Metrics]],
) -> dict[str, Scalar]:
    """The round's aggregated client metrics: ``hook``'s output, checked, or the weighted
    means without one; {} for no records, or when the hook fails (logged, naming it)."""
    if not records:
        return {}
    if hook is None:
        return dict(weighted_metric_means(records))
    # Copies: a hook that edits what it is given must not reach the clients' records.
    given = [(n, dict(m)) for n, m in records]
    try:
        return checked_output(hook(given), hook_name)
    except Exception as exc:
        logger.error("round %d: %s failed, its metrics are dropped for this round (the "
                     "model is not affected): %s: %s", server_round, hook_name,
                     type(exc).__name__, exc)
        return {}


def warn_unused_fit_hook(strategy: Any, why: str) -> None:
    """Say once, when a run is set up, that ``strategy``'s fit hook will not be called."""
    if getattr(strategy, "fit_metrics_aggregation_fn", None) is not None:
        logger.warning("fit_metrics_aggregation_fn is not called under %s", why)


class HookOutputError(ValueError):
    """A metrics aggregation hook returned something a round record cannot hold."""


def checked_output(output: Any, hook_name: str) -> dict[str, Scalar]:
    """``output`` as round metrics, or `HookOutputError` naming the hook and the entry."""
    if not isinstance(output, Mapping):
        raise HookOutputError(f"{hook_name} must return a dict of metrics, got "
                              f"{type(output).__name__}")
    if len(output) > MAX_HOOK_ENTRIES:
        raise HookOutputError(f"{hook_name} returned {len(output)} metrics; at most "
                              f"{MAX_HOOK_ENTRIES}")
    out: dict[str, Scalar] = {}
    for key, value in output.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_LENGTH:
            raise HookOutputError(f"{hook_name} returned the key {key!r}; keys are strings "
                                  f"of 1 to {MAX_KEY_LENGTH} characters")
        if isinstance(value, np.generic):
            value = value.item()
        if not isinstance(value, bool | int | float | str):  # bytes: not JSON
            raise HookOutputError(
                f"{hook_name} returned {key!r} = {value!r} ({type(value).__name__}); a "
                "metric must be a bool, int, float or str")
        try:  # the records' own rule (range, finiteness, length), not a copy of it
            checked_value(value, f"{hook_name} returned {key!r}")
        except ValueError as exc:
            raise HookOutputError(str(exc)) from exc
        out[key] = value
    return out
