"""Bulyan (El Mhamdi, Guerraoui and Rouault, "The Hidden Vulnerability of Distributed
Learning in Byzantium", ICML 2018).

With ``n`` updates of which at most ``f`` (``num_malicious_nodes``) are Byzantine:

1. select ``theta = n - 2f`` updates with a Byzantine-resilient rule: the paper applies
   Krum recursively, each time removing the chosen update from the candidates
   (``selection_rule = "krum"``, default); Flower 1.42 takes the ``theta`` best
   Multi-Krum scores of one pass over all ``n`` (``selection_rule = "multikrum"``);
2. for each coordinate, average the ``beta = theta - 2f`` selected values closest to
   the coordinate-wise median of the selected.

All steps are translation-invariant (distances between updates, distances to a median),
so Bulyan on deltas selects and averages the same as on client weights.

Precondition: ``n >= 4f + 3``. Below it, with ``enforce_preconditions`` (default) the
round raises `AggregationError`; without it the round yields no model and says why (a
`MeanUpdate` without a delta), which is Flower's ``(None, None)`` with a reason. The
server treats both as a failed round that leaves the model unchanged. When the
recursive Krum's candidate set shrinks below its own ``2f + 3`` bound (the last
``f`` or so picks), it uses Flower's ``max(1, n' - f - 2)`` neighbours.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

from fedloom.config import SelectionConfig
from fedloom.errors import AggregationError, ConfigError
from fedloom.strategies._base import MeanUpdate
from fedloom.strategies._composed import ComposedStrategy
from fedloom.strategies._holding import (
    HoldingAggregator,
    pairwise_squared_distances,
    per_tensor,
    stack,
)
from fedloom.strategies._krum import check_count, krum_scores, select_multikrum
from fedloom.strategies._metrics import MetricsAggregationFn
from fedloom.strategies._optimizers import ServerSGD
from fedloom.types import Scalar
from fedloom.weights import Weights

SelectionRule = Literal["krum", "multikrum"]
SELECTION_RULES: tuple[str, ...] = ("krum", "multikrum")


def select_recursive_krum(distances: np.ndarray, f: int, theta: int) -> list[int]:
    """Apply Krum ``theta`` times, removing each pick from the candidates (the paper)."""
    remaining = list(range(distances.shape[0]))
    chosen: list[int] = []
    for _ in range(theta):
        sub = distances[np.ix_(remaining, remaining)]
        scores = krum_scores(sub, max(1, len(remaining) - f - 2))
        best = remaining[int(np.argsort(scores, kind="stable")[0])]
        chosen.append(best)
        remaining.remove(best)
    return chosen


def closest_to_median_mean(values: np.ndarray, beta: int) -> np.ndarray:
    """Per coordinate, the mean of the ``beta`` values (axis 0) closest to the median."""
    median = np.median(values, axis=0)
    order = np.argsort(np.abs(values - median), axis=0, kind="stable")[:beta]
    return np.take_along_axis(values, order, axis=0).mean(axis=0)


class BulyanAggregator(HoldingAggregator):
    """Bulyan on the held deltas, in float64.

    Args:
        num_malicious_nodes: ``f``, >= 0.
        selection_rule: ``"krum"`` (recursive, the paper) or ``"multikrum"`` (Flower).
        enforce_preconditions: raise when ``n < 4f + 3`` (else: no model, with a reason).
    """

    def __init__(
        self,
        num_malicious_nodes: int = 0,
        selection_rule: SelectionRule = "krum",
        enforce_preconditions: bool = True,
    ) -> None:
        super().__init__()
        self.num_malicious_nodes = check_count("num_malicious_nodes", num_malicious_nodes, 0)
        if selection_rule not in SELECTION_RULES:
            raise ConfigError(
                "selection_rule",
                f"must be one of {', '.join(map(repr, SELECTION_RULES))}, got {selection_rule!r}",
            )
        self.selection_rule: SelectionRule = selection_rule
        self.enforce_preconditions = enforce_preconditions

    @property
    def min_updates(self) -> int:
        """``n >= 4f + 3`` (below it no model comes, enforced or not)."""
        return 4 * self.num_malicious_nodes + 3

    def combine(
        self, current: Weights, deltas: Sequence[Weights], num_examples: Sequence[int]
    ) -> MeanUpdate:
        n, f = len(deltas), self.num_malicious_nodes
        if n < 4 * f + 3:
            reason = (
                f"Bulyan precondition failed: it needs n >= 4f + 3 updates, i.e. at least "
                f"{4 * f + 3} with f={f} (num_malicious_nodes), got n={n}; lower "
                "num_malicious_nodes or sample more clients (min_fit_clients)"
            )
            if self.enforce_preconditions:
                raise AggregationError(reason)
            return MeanUpdate(None, 0.0, n, reason=reason)
        theta = n - 2 * f
        beta = theta - 2 * f
        distances = pairwise_squared_distances(deltas)
        if self.selection_rule == "krum":
            chosen = select_recursive_krum(distances, f, theta)
        else:
            chosen = select_multikrum(distances, f, theta, enforce=False, rule="Bulyan")
        selected = [deltas[i] for i in chosen]
        means = {name: closest_to_median_mean(stack(selected, name), beta) for name in current}
        total = float(sum(num_examples[i] for i in chosen))
        return MeanUpdate(per_tensor(current, means), total, n)


class Bulyan(ComposedStrategy):
    """Bulyan (El Mhamdi et al., 2018): Krum-style selection, then a median-trimmed mean.

    Flower 1.42's ``Bulyan``. Holds every update of the round.

    Args:
        num_malicious_nodes: f, the number of Byzantine clients to tolerate, >= 0.
            Default 0 (Flower's). A round needs n >= 4f + 3 updates.
        selection_rule: how the n - 2f updates are selected: "krum" (Krum applied
            recursively, the paper's, default) or "multikrum" (one pass of Multi-Krum
            scores, Flower's default rule).
        enforce_preconditions: when n < 4f + 3, raise `AggregationError` (default
            true), or yield no model with the reason (false; Flower returns None).
        selection: which clients each round samples (default: `SelectionConfig()`).
        fit_config: extra entries sent to every client with each fit task.
        evaluate_config: extra entries sent with each evaluate task.
        fit_metrics_aggregation_fn: Flower's hook over the clients' fit metrics
            (see `ComposedStrategy`; default: weighted means).
        evaluate_metrics_aggregation_fn: Flower's hook over the clients' evaluate
            metrics (see `ComposedStrategy`; default: weighted means).
    """

    def __init__(
        self,
        *,
        num_malicious_nodes: int = 0,
        selection_rule: SelectionRule = "krum",
        enforce_preconditions: bool = True,
        selection: SelectionConfig | None = None,
        fit_config: Mapping[str, Scalar] | None = None,
        evaluate_config: Mapping[str, Scalar] | None = None,
        fit_metrics_aggregation_fn: MetricsAggregationFn | None = None,
        evaluate_metrics_aggregation_fn: MetricsAggregationFn | None = None,
    ) -> None:
        super().__init__(
            BulyanAggregator(num_malicious_nodes, selection_rule, enforce_preconditions),
            ServerSGD(1.0),
            selection=selection,
            fit_config=fit_config,
            evaluate_config=evaluate_config,
            fit_metrics_aggregation_fn=fit_metrics_aggregation_fn,
            evaluate_metrics_aggregation_fn=evaluate_metrics_aggregation_fn,
        )
