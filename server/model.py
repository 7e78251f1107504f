"""The global model as the server holds it: the weights and the one serialized payload
every fit and evaluate task broadcasts.

The weights are views into the payload (one copy of the model, not two), and installing
a new model lets go of the old payload before building the new one (two copies at the
peak, not three).
"""

from __future__ import annotations

from fedloom.payload import PayloadInfo, deserialize, serialize
from fedloom.server.persistence import RunPersistence
from fedloom.weights import Weights


class GlobalModel:
    """The current global weights and their broadcast payload."""

    def __init__(self, persistence: RunPersistence) -> None:
        self._persistence = persistence
        self.payload = memoryview(b"")
        #: The round (model version) that produced these weights (0: the initial model).
        self.version = persistence.completed_round
        self.install(persistence.weights, self.version)

    def install(self, weights: Weights, version: int) -> None:
        """Make ``weights``, produced by round ``version``, the global model (also what
        the next commit writes)."""
        # Nothing else runs on the loop until this returns: drop the old payload first.
        self.payload = memoryview(b"")
        self.weights = self._persistence.weights = weights
        payload = serialize(weights)
        self.weights = deserialize(weights.specs(), payload)
        self.payload = payload
        self.info = PayloadInfo.describe(weights.specs(), payload)
        self.version = version
        self._persistence.weights = self.weights  # not a second copy of the model

    @property
    def num_bytes(self) -> int:
        return self.info.total_bytes
