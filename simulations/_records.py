"""Conversions between fedloom's kernel types and Flower's records (``flwr.app``).

Flower's conventions (message API, flwr 1.42): a train instruction carries the global
model as an ``ArrayRecord`` under ``"arrays"`` and a ``ConfigRecord`` under
``"config"``; a reply carries the client's *new weights* (not a delta) under
``"arrays"`` and a ``MetricRecord`` under ``"metrics"`` whose ``"num-examples"`` is
the aggregation weight. Our bridges keep to these, so a fedloom ClientApp also works
under Flower's own strategies and a fedloom strategy under Flower's own ClientApps.
"""

from __future__ import annotations

from collections.abc import Mapping

from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

from fedloom.types import Metrics, Scalar
from fedloom.weights import Weights

ARRAYS_KEY = "arrays"
CONFIG_KEY = "config"
METRICS_KEY = "metrics"
NUM_EXAMPLES_KEY = "num-examples"
#: Message type of the identity query the strategy bridge sends once per new node.
IDENTITY_MESSAGE_TYPE = "query.fedloom_identity"
PARTITION_ID_KEY = "partition-id"


def weights_to_arrays(weights: Weights) -> ArrayRecord:
    """`Weights` as an ``ArrayRecord``, names and order kept."""
    return ArrayRecord({name: Array(arr) for name, arr in weights.items()})


def arrays_to_weights(record: ArrayRecord) -> Weights:
    """An ``ArrayRecord`` as `Weights`, names and order kept."""
    return Weights((name, array.numpy()) for name, array in record.items())


def config_to_record(config: Mapping[str, Scalar]) -> ConfigRecord:
    """A fedloom config as a ``ConfigRecord`` (every fedloom scalar is a Flower scalar)."""
    return ConfigRecord(dict(config))


def record_to_config(record: ConfigRecord | MetricRecord) -> dict[str, Scalar]:
    """A Flower record as a fedloom config/metrics mapping, dropping list values."""
    return {k: v for k, v in record.items() if isinstance(v, bool | int | float | str | bytes)}


def metrics_to_record(metrics: Metrics, num_examples: int | None = None) -> MetricRecord:
    """Numeric metrics as a ``MetricRecord`` (str/bytes dropped, bools as 0/1).

    ``num_examples``, when given, is stored under Flower's weighting key ``num-examples``.
    """
    out: dict[str, int | float] = {}
    for key, value in metrics.items():
        if isinstance(value, bool):
            out[key] = int(value)
        elif isinstance(value, int | float):
            out[key] = value
    if num_examples is not None:
        out[NUM_EXAMPLES_KEY] = num_examples
    return MetricRecord(out)  # type: ignore[arg-type]
