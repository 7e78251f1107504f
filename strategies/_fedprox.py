"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020).

The server side of FedProx is FedAvg's aggregation; what changes is the client's local
objective, ``loss + proximal_mu / 2 * ||w - w_global||²``. The strategy sends
``proximal_mu`` in every fit config (key ``"proximal_mu"``; Flower 1.42's message API
sends it as ``"proximal-mu"``) and `TorchClient` applies it. A client that applies the
term echoes the value back as the fit metric ``"proximal_mu"``; updates that do not
(missing, or another value) are counted in the round metric
``"num_ignored_proximal_mu"`` and named in a warning in the log, so an operator can
see clients that ignore it (their updates still count: FedProx tolerates partial work).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping

from fedloom.config import SelectionConfig
from fedloom.errors import ConfigError
from fedloom.fit_config import PROXIMAL_MU
from fedloom.strategies._composed import ComposedStrategy
from fedloom.strategies._mean import WeightedMeanAggregator
from fedloom.strategies._metrics import MetricsAggregationFn
from fedloom.strategies._optimizers import ServerSGD
from fedloom.types import AggregateResult, ClientUpdate, Config, Scalar
from fedloom.weights import Weights

#: The fit-config key (and echoed fit metric) that carries ``proximal_mu``.
PROXIMAL_MU_KEY = PROXIMAL_MU
#: Round metric: updates whose metrics do not echo the ``proximal_mu`` that was sent.
IGNORED_METRIC = "num_ignored_proximal_mu"

logger = logging.getLogger(__name__)


class FedProx(ComposedStrategy):
    """FedProx (Li et al., 2020): FedAvg's aggregation, ``proximal_mu`` sent to clients.

    Flower 1.42's ``FedProx``. The round metric ``num_ignored_proximal_mu`` counts updates
    that do not echo ``proximal_mu`` in their metrics.

    Args:
        proximal_mu: weight of the proximal term, >= 0. Default 0.0 (Flower's; then
            FedProx is FedAvg). Li et al. tune it in {0.001, 0.01, 0.1, 0.5, 1}.
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
        proximal_mu: float = 0.0,
        selection: SelectionConfig | None = None,
        fit_config: Mapping[str, Scalar] | None = None,
        evaluate_config: Mapping[str, Scalar] | None = None,
        fit_metrics_aggregation_fn: MetricsAggregationFn | None = None,
        evaluate_metrics_aggregation_fn: MetricsAggregationFn | None = None,
    ) -> None:
        if not (math.isfinite(proximal_mu) and proximal_mu >= 0):
            raise ConfigError("proximal_mu", f"must be a number >= 0, got {proximal_mu}")
        super().__init__(
            WeightedMeanAggregator(),
            ServerSGD(1.0),
            selection=selection,
            fit_config=fit_config,
            evaluate_config=evaluate_config,
            fit_metrics_aggregation_fn=fit_metrics_aggregation_fn,
            evaluate_metrics_aggregation_fn=evaluate_metrics_aggregation_fn,
        )
        self.proximal_mu = float(proximal_mu)

    def fit_round_config(self, server_round: int) -> Config:
        return {**super().fit_round_config(server_round), PROXIMAL_MU_KEY: self.proximal_mu}

    def aggregate_fit(
        self, server_round: int, current: Weights, updates: Iterable[ClientUpdate]
    ) -> AggregateResult:
        ignored: list[str] = []

        def watched() -> Iterator[ClientUpdate]:
            for update in updates:
                echoed = update.metrics.get(PROXIMAL_MU_KEY)
                if self.proximal_mu > 0 and not _same(echoed, self.proximal_mu):
                    ignored.append(update.client_id)
                yield update

        result = super().aggregate_fit(server_round, current, watched())
        if ignored:
            shown = ", ".join(ignored[:10]) + (", ..." if len(ignored) > 10 else "")
            logger.warning(
                "round %d: %d update(s) did not apply proximal_mu=%g (no matching "
                "'proximal_mu' fit metric): %s", server_round, len(ignored), self.proximal_mu,
                shown,
            )
        return AggregateResult(
            result.weights, {**result.metrics, IGNORED_METRIC: len(ignored)},
            num_updates=result.num_updates, reason=result.reason,
        )


def _same(echoed: Scalar | None, mu: float) -> bool:
    if isinstance(echoed, bool) or not isinstance(echoed, int | float):
        return False
    return math.isclose(float(echoed), mu, rel_tol=1e-6, abs_tol=0.0)
