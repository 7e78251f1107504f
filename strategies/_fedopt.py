"""The FedOpt strategies (Reddi et al., "Adaptive Federated Optimization", ICLR 2021):
FedAdagrad, FedAdam and FedYogi.

Each is a streaming weighted mean of the deltas (by ``num_examples``) followed by an
adaptive server step (`strategies._adaptive`). Names and defaults are Flower 1.42's
message-API ones (``flwr.serverapp.strategy``): ``tau = 1e-3`` everywhere; FedAdam
``eta = eta_l = 0.1``, ``beta_1 = 0.9``, ``beta_2 = 0.99``; FedYogi ``eta = 0.01``,
``eta_l = 0.0316``, ``beta_1 = 0.9``, ``beta_2 = 0.99``; FedAdagrad ``eta = eta_l = 0.1``.

``eta_l``, the client learning rate, is sent to every client in the fit config under
the key ``"eta_l"`` (Flower only logs it); `TorchClient` applies it to its optimizer
unless the fit config also holds ``"lr"``, which wins.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from fedloom.config import SelectionConfig
from fedloom.errors import ConfigError
from fedloom.fit_config import CLIENT_LR
from fedloom.strategies._adaptive import (
    AdaptiveServerOptimizer,
    BiasCorrection,
    ServerAdagrad,
    ServerAdam,
    ServerYogi,
)
from fedloom.strategies._composed import ComposedStrategy
from fedloom.strategies._mean import WeightedMeanAggregator
from fedloom.strategies._metrics import MetricsAggregationFn
from fedloom.types import Config, Scalar

#: The fit-config key that carries the client learning rate ``eta_l``.
CLIENT_LR_KEY = CLIENT_LR


class _FedOpt(ComposedStrategy):
    """Shared by the FedOpt presets: the weighted mean, an adaptive step, ``eta_l`` sent."""

    def __init__(
        self,
        optimizer: AdaptiveServerOptimizer,
        eta_l: float,
        *,
        selection: SelectionConfig | None,
        fit_config: Mapping[str, Scalar] | None,
        evaluate_config: Mapping[str, Scalar] | None,
        fit_metrics_aggregation_fn: MetricsAggregationFn | None,
        evaluate_metrics_aggregation_fn: MetricsAggregationFn | None,
    ) -> None:
        if not (math.isfinite(eta_l) and eta_l > 0):
            raise ConfigError("eta_l", f"must be a positive number, got {eta_l}")
        super().__init__(
            WeightedMeanAggregator(),
            optimizer,
            selection=selection,
            fit_config=fit_config,
            evaluate_config=evaluate_config,
            fit_metrics_aggregation_fn=fit_metrics_aggregation_fn,
            evaluate_metrics_aggregation_fn=evaluate_metrics_aggregation_fn,
        )
        self.eta_l = float(eta_l)

    def fit_round_config(self, server_round: int) -> Config:
        return {**super().fit_round_config(server_round), CLIENT_LR_KEY: self.eta_l}


class FedAdagrad(_FedOpt):
    """FedAdagrad (Reddi et al., 2021): the weighted mean applied by a server Adagrad step.

    Args:
        eta: server learning rate, > 0. Default 0.1 (Flower's).
        eta_l: client learning rate, > 0, sent to clients as fit-config ``"eta_l"``.
            Default 0.1 (Flower's).
        tau: adaptivity, added to ``sqrt(v)``, > 0. Default 1e-3 (Flower's message API).
        beta_1: first-moment decay in [0, 1). Default 0.0 (Flower fixes it at 0; Reddi
            et al.'s Algorithm 2 allows momentum here too).
        initial_accumulator: starting value of ``v``, >= 0. Default 0.0 (Flower's);
            Reddi et al. ask for at least ``tau**2``.
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
        eta: float = 1e-1,
        eta_l: float = 1e-1,
        tau: float = 1e-3,
        beta_1: float = 0.0,
        initial_accumulator: float = 0.0,
        selection: SelectionConfig | None = None,
        fit_config: Mapping[str, Scalar] | None = None,
        evaluate_config: Mapping[str, Scalar] | None = None,
        fit_metrics_aggregation_fn: MetricsAggregationFn | None = None,
        evaluate_metrics_aggregation_fn: MetricsAggregationFn | None = None,
    ) -> None:
        super().__init__(
            ServerAdagrad(eta=eta, beta_1=beta_1, beta_2=0.0, tau=tau,
                          initial_accumulator=initial_accumulator),
            eta_l,
            selection=selection,
            fit_config=fit_config,
            evaluate_config=evaluate_config,
            fit_metrics_aggregation_fn=fit_metrics_aggregation_fn,
            evaluate_metrics_aggregation_fn=evaluate_metrics_aggregation_fn,
        )


class FedAdam(_FedOpt):
    """FedAdam (Reddi et al., 2021): the weighted mean applied by a server Adam step.

    Args:
        eta: server learning rate, > 0. Default 0.1 (Flower's).
        eta_l: client learning rate, > 0, sent to clients as fit-config ``"eta_l"``.
            Default 0.1 (Flower's).
        beta_1: first-moment decay in [0, 1). Default 0.9 (Flower's).
        beta_2: second-moment decay in [0, 1). Default 0.99 (Flower's).
        tau: adaptivity, added to ``sqrt(v)``, > 0. Default 1e-3 (Flower's message API).
        bias_correction: "none" (Reddi et al.: no correction, default), "adam" (Kingma
            and Ba's, t = server steps taken) or "flower" (Flower 1.42's, exponent t + 1).
        initial_accumulator: starting value of ``v``, >= 0. Default 0.0 (Flower's);
            Reddi et al. ask for at least ``tau**2``.
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
        eta: float = 1e-1,
        eta_l: float = 1e-1,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        tau: float = 1e-3,
        bias_correction: BiasCorrection = "none",
        initial_accumulator: float = 0.0,
        selection: SelectionConfig | None = None,
        fit_config: Mapping[str, Scalar] | None = None,
        evaluate_config: Mapping[str, Scalar] | None = None,
        fit_metrics_aggregation_fn: MetricsAggregationFn | None = None,
        evaluate_metrics_aggregation_fn: MetricsAggregationFn | None = None,
    ) -> None:
        super().__init__(
            ServerAdam(eta=eta, beta_1=beta_1, beta_2=beta_2, tau=tau,
                       initial_accumulator=initial_accumulator,
                       bias_correction=bias_correction),
            eta_l,
            selection=selection,
            fit_config=fit_config,
            evaluate_config=evaluate_config,
            fit_metrics_aggregation_fn=fit_metrics_aggregation_fn,
            evaluate_metrics_aggregation_fn=evaluate_metrics_aggregation_fn,
        )


class FedYogi(_FedOpt):
    """FedYogi (Reddi et al., 2021): the weighted mean applied by a server Yogi step.

    Args:
        eta: server learning rate, > 0. Default 0.01 (Flower's).
        eta_l: client learning rate, > 0, sent to clients as fit-config ``"eta_l"``.
            Default 0.0316 (Flower's).
        beta_1: first-moment decay in [0, 1). Default 0.9 (Flower's).
        beta_2: second-moment decay in [0, 1). Default 0.99 (Flower's).
        tau: adaptivity, added to ``sqrt(v)``, > 0. Default 1e-3 (Flower's message API).
        initial_accumulator: starting value of ``v``, >= 0. Default 0.0 (Flower's);
            Reddi et al. ask for at least ``tau**2``.
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
        eta: float = 1e-2,
        eta_l: float = 0.0316,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        tau: float = 1e-3,
        initial_accumulator: float = 0.0,
        selection: SelectionConfig | None = None,
        fit_config: Mapping[str, Scalar] | None = None,
        evaluate_config: Mapping[str, Scalar] | None = None,
        fit_metrics_aggregation_fn: MetricsAggregationFn | None = None,
        evaluate_metrics_aggregation_fn: MetricsAggregationFn | None = None,
    ) -> None:
        super().__init__(
            ServerYogi(eta=eta, beta_1=beta_1, beta_2=beta_2, tau=tau,
                       initial_accumulator=initial_accumulator),
            eta_l,
            selection=selection,
            fit_config=fit_config,
            evaluate_config=evaluate_config,
            fit_metrics_aggregation_fn=fit_metrics_aggregation_fn,
            evaluate_metrics_aggregation_fn=evaluate_metrics_aggregation_fn,
        )
