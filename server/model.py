"""The global model as the server holds it: the weights and the one serialized payload
every fit and evaluate task broadcasts.

The weights are views into the payload (one copy of the model, not two), and installing
a new model lets go of the old payload before building the new one (two copies at the
peak, not three). A model broadcast with a download codec (``[compression] download``)
is encoded once per model version and codec, when the first task needs it, and shared
by every client granted that codec; installing a new model drops those payloads too.
The zstd frame of a broadcast (plain or encoded) is built the same way: once per model
version and codec, for the clients granted the stage.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from fedloom.compression import CodecSpec, CompressionError, compress, encode
from fedloom.payload import PayloadInfo, deserialize, serialize
from fedloom.server.persistence import RunPersistence
from fedloom.weights import Weights

log = logging.getLogger("fedloom.server")


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
        self._encoded: dict[CodecSpec, tuple[PayloadInfo, memoryview] | None] = {}
        self._frames: dict[CodecSpec | None, tuple[PayloadInfo, memoryview] | None] = {}
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

    def encoded(self, spec: CodecSpec) -> tuple[PayloadInfo, memoryview] | None:
        """The model encoded with ``spec`` (a download codec), built on first use; None
        when this model cannot be (fp16 and a value beyond its range): it is then sent
        plain, and the server says so once per model version."""
        if spec not in self._encoded:
            try:
                # fp16 and bf16 are deterministic: the generator is never drawn from.
                weights = encode(spec.build(), self.weights, np.random.default_rng(0))
            except CompressionError as exc:
                log.warning("model version %d is broadcast plain to clients granted %s: %s",
                            self.version, spec, exc)
                self._encoded[spec] = None
            else:
                payload = serialize(weights)
                self._encoded[spec] = (PayloadInfo.describe(weights.specs(), payload), payload)
        return self._encoded[spec]

    def compressed(self, spec: CodecSpec | None) -> tuple[PayloadInfo, memoryview] | None:
        """The broadcast encoded with ``spec`` (None: plain) as a zstd frame, built on
        first use; None when the frame would not be smaller (the payload goes as it is)."""
        if spec not in self._frames:
            encoded = self.encoded(spec) if spec is not None else None
            info, payload = encoded or (self.info, self.payload)
            frame = compress(payload)
            self._frames[spec] = None if frame is None else (
                dataclasses.replace(info, wire_bytes=len(frame)), memoryview(frame))
        return self._frames[spec]
