"""Krum and Multi-Krum (Blanchard, El Mhamdi, Guerraoui and Stainer, "Machine Learning
with Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017).

With ``n`` updates of which at most ``f`` (``num_malicious_nodes``) are Byzantine, each
update's score is the sum of its squared L2 distances to its ``n - f - 2`` nearest
other updates. Krum returns the update with the lowest score; Multi-Krum averages the
``m`` (``num_nodes_to_select``) lowest-scoring ones, unweighted as in the paper.
Distances between deltas equal distances between client weights
(``Δ_i - Δ_j = w_i - w_j``), so selecting on deltas selects the same clients.

Precondition (the paper's): ``n > 2f + 2``. With ``enforce_preconditions`` (default) a
round below it raises `AggregationError`; without it the rule runs with Flower 1.42's
``max(1, n - f - 2)`` neighbours. Ties in score go to the update that arrived first.

Where Flower 1.42 differs: it never checks ``n > 2f + 2``; its Multi-Krum averages the
selected updates weighted by ``num_examples`` (``weighted_by_examples = true`` here);
its float32 distances (``||x||² + ||y||² - 2 x·y``) make near-ties arbitrary; ours are
float64.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
from fedloom.strategies._metrics import MetricsAggregationFn
from fedloom.strategies._optimizers import ServerSGD
from fedloom.types import Scalar
from fedloom.weights import Weights

_FIX = ("lower num_malicious_nodes, sample more clients (min_fit_clients), or set "
        "enforce_preconditions = false for Flower's unchecked behaviour")


def check_count(setting: str, value: int, minimum: int) -> int:
    """Validate an integer setting (bools refused) and return it."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ConfigError(setting, f"must be an integer >= {minimum}, got {value!r}")
    return int(value)


def krum_scores(distances: np.ndarray, num_neighbours: int) -> np.ndarray:
    """Each row's sum of its ``num_neighbours`` smallest distances to the other rows."""
    n = distances.shape[0]
    k = min(num_neighbours, n - 1)
    if k <= 0:
        return np.zeros(n, dtype=np.float64)
    others = distances.copy()
    np.fill_diagonal(others, np.inf)
    return np.partition(others, k - 1, axis=1)[:, :k].sum(axis=1)


def krum_neighbours(n: int, f: int, enforce: bool, rule: str) -> int:
    """``n - f - 2``, after checking ``n > 2f + 2`` (or Flower's ``max(1, ...)``)."""
    if enforce and not n > 2 * f + 2:
        raise AggregationError(
            f"{rule} precondition failed: it needs n > 2f + 2 updates, i.e. at least "
            f"{2 * f + 3} with f={f} (num_malicious_nodes), got n={n}; {_FIX}"
        )
    return n - f - 2 if enforce else max(1, n - f - 2)


def select_multikrum(
    distances: np.ndarray, f: int, m: int, *, enforce: bool = True, rule: str = "Multi-Krum"
) -> list[int]:
    """Indices of the ``m`` lowest Krum scores (stable: ties go to the lower index)."""
    n = distances.shape[0]
    k = krum_neighbours(n, f, enforce, rule)
    if enforce and m > n:
        raise AggregationError(
            f"{rule} precondition failed: num_nodes_to_select={m} exceeds the {n} updates "
            "received; lower num_nodes_to_select or sample more clients"
        )
    order = np.argsort(krum_scores(distances, k), kind="stable")
    return [int(i) for i in order[:m]]


class KrumAggregator(HoldingAggregator):
    """Krum (``num_nodes_to_select = 1``) or Multi-Krum selection, then the mean.

    Args:
        num_malicious_nodes: ``f``, the Byzantine updates to tolerate, >= 0.
        num_nodes_to_select: ``m``, how many lowest-scoring updates to average, >= 1.
        weighted_by_examples: average the selected by ``num_examples`` (Flower) instead
            of uniformly (the paper).
        enforce_preconditions: raise unless ``n > 2f + 2`` and ``m <= n``.
    """

    def __init__(
        self,
        num_malicious_nodes: int = 0,
        num_nodes_to_select: int = 1,
        weighted_by_examples: bool = False,
        enforce_preconditions: bool = True,
    ) -> None:
        super().__init__()
        self.num_malicious_nodes = check_count("num_malicious_nodes", num_malicious_nodes, 0)
        self.num_nodes_to_select = check_count("num_nodes_to_select", num_nodes_to_select, 1)
        self.weighted_by_examples = weighted_by_examples
        self.enforce_preconditions = enforce_preconditions

    @property
    def min_updates(self) -> int:
        """``n > 2f + 2`` and ``m <= n``, when preconditions are enforced."""
        if not self.enforce_preconditions:
            return 1
        return max(2 * self.num_malicious_nodes + 3, self.num_nodes_to_select)

    def combine(
        self, current: Weights, deltas: Sequence[Weights], num_examples: Sequence[int]
    ) -> MeanUpdate:
        rule = "Krum" if self.num_nodes_to_select == 1 else "Multi-Krum"
        chosen = select_multikrum(
            pairwise_squared_distances(deltas), self.num_malicious_nodes,
            self.num_nodes_to_select, enforce=self.enforce_preconditions, rule=rule,
        )
        weights = np.array(
            [float(num_examples[i]) if self.weighted_by_examples else 1.0 for i in chosen]
        )
        weights /= weights.sum()
        means = {
            name: np.tensordot(weights, stack([deltas[i] for i in chosen], name), axes=1)
            for name in current
        }
        total = float(sum(num_examples[i] for i in chosen))
        return MeanUpdate(per_tensor(current, means), total, len(deltas))


class Krum(ComposedStrategy):
    """Krum (Blanchard et al., 2017): the one update closest to its neighbours.

    Flower 1.42's ``Krum``. Holds every update of the round.

    Args:
        num_malicious_nodes: f, the number of Byzantine clients to tolerate, >= 0.
            Default 0 (Flower's). A round needs n > 2f + 2 updates.
        enforce_preconditions: raise `AggregationError` when n <= 2f + 2. Default true;
            false is Flower's behaviour (no check, max(1, n - f - 2) neighbours).
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
        enforce_preconditions: bool = True,
        selection: SelectionConfig | None = None,
        fit_config: Mapping[str, Scalar] | None = None,
        evaluate_config: Mapping[str, Scalar] | None = None,
        fit_metrics_aggregation_fn: MetricsAggregationFn | None = None,
        evaluate_metrics_aggregation_fn: MetricsAggregationFn | None = None,
    ) -> None:
        super().__init__(
            KrumAggregator(num_malicious_nodes, 1, False, enforce_preconditions),
            ServerSGD(1.0),
            selection=selection,
            fit_config=fit_config,
            evaluate_config=evaluate_config,
            fit_metrics_aggregation_fn=fit_metrics_aggregation_fn,
            evaluate_metrics_aggregation_fn=evaluate_metrics_aggregation_fn,
        )


class MultiKrum(ComposedStrategy):
    """Multi-Krum (Blanchard et al., 2017): the mean of the m updates with the best Krum scores.

    Flower 1.42's ``MultiKrum``. Holds every update of the round.

    Args:
        num_malicious_nodes: f, the number of Byzantine clients to tolerate, >= 0.
            Default 0 (Flower's). A round needs n > 2f + 2 updates.
        num_nodes_to_select: m, how many lowest-scoring updates are averaged, >= 1.
            Default 1 (Flower's; that is Krum).
        weighted_by_examples: weight the selected updates by num_examples (Flower's
            behaviour) instead of uniformly (the paper's, default false; uniform also
            denies a client that inflates num_examples any extra weight).
        enforce_preconditions: raise `AggregationError` when n <= 2f + 2 or m > n.
            Default true; false is Flower's behaviour (no checks).
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
        num_nodes_to_select: int = 1,
        weighted_by_examples: bool = False,
        enforce_preconditions: bool = True,
        selection: SelectionConfig | None = None,
        fit_config: Mapping[str, Scalar] | None = None,
        evaluate_config: Mapping[str, Scalar] | None = None,
        fit_metrics_aggregation_fn: MetricsAggregationFn | None = None,
        evaluate_metrics_aggregation_fn: MetricsAggregationFn | None = None,
    ) -> None:
        super().__init__(
            KrumAggregator(num_malicious_nodes, num_nodes_to_select, weighted_by_examples,
                           enforce_preconditions),
            ServerSGD(1.0),
            selection=selection,
            fit_config=fit_config,
            evaluate_config=evaluate_config,
            fit_metrics_aggregation_fn=fit_metrics_aggregation_fn,
            evaluate_metrics_aggregation_fn=evaluate_metrics_aggregation_fn,
        )
