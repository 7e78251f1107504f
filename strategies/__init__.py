"""Aggregation strategies: pure numpy math on kernel types.

Never imports the server, grpc, protobuf, torch or flwr. See `strategies._base` for the
contract, `build_strategy` for building one by name from configuration and
`describe_strategies` for the list of names and settings. Every strategy samples clients
with the `SelectionConfig` it is given (``FedAvg(selection=SelectionConfig(...))``).

Linear strategies (FedAvg, FedAvgM, FedProx, FedAdagrad, FedAdam, FedYogi) aggregate as
a stream; the robust ones (FedMedian, FedTrimmedAvg, Krum, MultiKrum, Bulyan) hold the
round's updates (their aggregator's ``holds_all_updates`` is true). `NormBoundedStrategy`
bounds update norms for any of them; `clip_update` is the client-side form.
`CentralDPStrategy` (built by `apply_privacy` from a ``[privacy]`` table) makes a
mean-based strategy differentially private. `aggregate_secure_mean` hands a secure
round's mean (SecAgg+: the server holds only the sum) to a mean-based strategy, and
`check_secure_strategy` refuses the others. Every strategy takes Flower's
``fit_metrics_aggregation_fn`` and ``evaluate_metrics_aggregation_fn`` hooks (a
`MetricsAggregationFn`; when they are called: `strategies._metrics`).
"""

from fedloom.config import SelectionConfig
from fedloom.strategies._adaptive import (
    AdaptiveServerOptimizer,
    ServerAdagrad,
    ServerAdam,
    ServerYogi,
)
from fedloom.strategies._base import (
    Aggregator,
    MeanUpdate,
    NonFiniteStepError,
    ServerOptimizer,
    StateDict,
    Strategy,
    aggregator_of,
    check_finite_step,
    min_updates,
    privacy_spent_metrics,
)
from fedloom.strategies._bulyan import Bulyan, BulyanAggregator
from fedloom.strategies._composed import ComposedStrategy
from fedloom.strategies._dp import CentralDPStrategy, apply_privacy
from fedloom.strategies._fedavg import FedAvg
from fedloom.strategies._fedopt import FedAdagrad, FedAdam, FedYogi
from fedloom.strategies._fedprox import FedProx
from fedloom.strategies._holding import HoldingAggregator
from fedloom.strategies._krum import Krum, KrumAggregator, MultiKrum
from fedloom.strategies._mean import WeightedMeanAggregator, check_aggregatable
from fedloom.strategies._median import CoordinateMedianAggregator, FedMedian
from fedloom.strategies._metrics import HookOutputError, MetricsAggregationFn, checked_output
from fedloom.strategies._momentum import FedAvgM, ServerMomentum
from fedloom.strategies._norm_bound import NormBoundedStrategy, clip_update, update_norm
from fedloom.strategies._optimizers import ServerSGD, add_delta
from fedloom.strategies._registry import (
    STRATEGIES,
    build_strategy,
    describe_strategies,
    strategy_settings,
)
from fedloom.strategies._sampling import ClientSampler
from fedloom.strategies._secure_mean import (
    MEAN_STRATEGIES,
    aggregate_secure_mean,
    check_secure_strategy,
)
from fedloom.strategies._staleness import (
    StalenessWeighting,
    check_robust_async,
    holds_all_updates,
    scale_delta,
    stale_update,
    weighted_updates,
)
from fedloom.strategies._trimmed_mean import FedTrimmedAvg, TrimmedMeanAggregator

__all__ = [
    "MEAN_STRATEGIES",
    "STRATEGIES",
    "AdaptiveServerOptimizer",
    "Aggregator",
    "Bulyan",
    "BulyanAggregator",
    "CentralDPStrategy",
    "ClientSampler",
    "ComposedStrategy",
    "CoordinateMedianAggregator",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedMedian",
    "FedProx",
    "FedTrimmedAvg",
    "FedYogi",
    "HoldingAggregator",
    "HookOutputError",
    "Krum",
    "KrumAggregator",
    "MeanUpdate",
    "MetricsAggregationFn",
    "MultiKrum",
    "NonFiniteStepError",
    "NormBoundedStrategy",
    "SelectionConfig",
    "ServerAdagrad",
    "ServerAdam",
    "ServerMomentum",
    "ServerOptimizer",
    "ServerSGD",
    "ServerYogi",
    "StalenessWeighting",
    "StateDict",
    "Strategy",
    "TrimmedMeanAggregator",
    "WeightedMeanAggregator",
    "add_delta",
    "aggregate_secure_mean",
    "aggregator_of",
    "apply_privacy",
    "build_strategy",
    "check_aggregatable",
    "check_finite_step",
    "check_robust_async",
    "check_secure_strategy",
    "checked_output",
    "clip_update",
    "describe_strategies",
    "holds_all_updates",
    "min_updates",
    "privacy_spent_metrics",
    "scale_delta",
    "stale_update",
    "strategy_settings",
    "update_norm",
    "weighted_updates",
]
