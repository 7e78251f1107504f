"""`MetricsConfig`: the ``[metrics]`` settings, what the run store keeps of the clients'
metrics.

.. code-block:: toml

    [metrics]
    per_client = false    # keep only each round's aggregates (default: true)

Each round's aggregated metrics are always recorded. With ``per_client`` (the default)
each client's fit result (its ``num_examples`` and the metrics it sent) and evaluate
result (``num_examples``, loss, metrics) is recorded too, beside the round, and
``fedloom runs RUN --clients`` shows them. Turn it off where the operator must not keep
a per-client trace. A run under secure aggregation or ``[privacy]`` records none
whatever this says: there the server sees no client's fit metrics (SecAgg+), or they
are outside the privacy guarantee, and a secure or private run keeps only aggregates.
"""

from __future__ import annotations

import dataclasses

from fedloom.settings import check, described

SECTION = "metrics"


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    """What the run store keeps of the clients' metrics (see the module docstring)."""

    per_client: bool = described(
        True, "record each client's fit and evaluate metrics for every round in the run "
              "store (fedloom runs RUN --clients); never under secure aggregation or "
              "[privacy]")

    def __post_init__(self) -> None:
        check(isinstance(self.per_client, bool), f"{SECTION}.per_client",
              f"must be true or false, got {self.per_client!r}")
