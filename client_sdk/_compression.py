"""Compression on the client's side (docs/compression.md): decode the model a task
carries with the download codec this session was granted, and encode each update with
the granted upload codec, then compress it with zstd when that stage was granted too and
the frame is smaller (otherwise it goes uncompressed: a grant is a permission).

Top-k updates go through error feedback (`fedloom.compression.ErrorFeedback`): what a
round's top-k leaves out is added to the next round's update. The residual is the
client's own and is never sent; with ``ClientConfig.state_dir`` it is saved there after
every update (written atomically), so it survives a restart of the client, otherwise it
lives in memory and a restart starts again from zero. One residual is kept per run: a
new run (another ``run_id``) starts from zero and deletes the old run's file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path

import numpy as np

from fedloom.compression import (
    CodecSpec,
    CompressionError,
    ErrorFeedback,
    compress,
    decode,
    encode,
)
from fedloom.errors import TransportError
from fedloom.messages import TaskHeader
from fedloom.payload import PayloadInfo, serialize, serialize_difference
from fedloom.weights import Weights

log = logging.getLogger("fedloom.client")

#: The folder of ``state_dir`` that holds the error-feedback residuals.
FEEDBACK_FOLDER = "error-feedback"


def decode_model(task: TaskHeader, payload: Weights, granted: CodecSpec | None) -> Weights:
    """The model a task carries: ``payload`` itself, or decoded when the task is encoded.

    Raises:
        TransportError: the task is encoded with a codec this session was not granted,
            or its payload does not decode.
    """
    codec = task.codec
    if codec is None:
        return payload
    if codec != granted:
        raise TransportError(
            f"the server sent the model encoded with {codec}, but this session was granted "
            f"{granted if granted is not None else 'no download codec'}")
    try:
        return decode(codec.build(), task.decoded, payload)
    except CompressionError as exc:
        raise TransportError(f"the task's weights do not decode with {codec}: {exc}") from exc


class UpdateEncoder:
    """Turns new local weights into the payload of a fit result, encoded with the
    session's upload codec when it has one (see the module docstring)."""

    def __init__(self, state_dir: str = "") -> None:
        self.state_dir = Path(state_dir) if state_dir else None
        self._feedback: tuple[str, ErrorFeedback] | None = None  # (run id, its residual)
        self._rng = np.random.default_rng()  # stochastic rounding: fresh OS entropy

    def update(self, run_id: str, codec: CodecSpec | None, new: Weights, base: Weights,
               zstd: bool = False) -> tuple[memoryview, PayloadInfo, CodecSpec | None]:
        """The payload of ``new - base`` as it travels, its header, and the codec it is
        encoded with (None: plain, also when the codec cannot carry this update, e.g.
        fp16 and a value beyond its range). With ``zstd`` the payload is the zstd frame
        when that is smaller (its header's ``wire_bytes`` then says so)."""
        payload, info, used = self._encoded(run_id, codec, new, base)
        frame = compress(payload) if zstd else None
        if frame is None:
            return payload, info, used
        return memoryview(frame), dataclasses.replace(info, wire_bytes=len(frame)), used

    def _encoded(self, run_id: str, codec: CodecSpec | None, new: Weights, base: Weights
                 ) -> tuple[memoryview, PayloadInfo, CodecSpec | None]:
        if codec is not None:
            delta = new.subtract(base)
            try:
                if codec.name == "topk":
                    encoded = self.feedback(run_id, codec).encode(delta, self._rng)
                else:
                    encoded = encode(codec.build(), delta, self._rng)
            except CompressionError as exc:
                log.warning("this update cannot be encoded with %s (%s); sending it plain",
                            codec, exc)
            else:
                payload = serialize(encoded)
                return payload, PayloadInfo.describe(encoded.specs(), payload), codec
        payload = serialize_difference(new, base)
        return payload, PayloadInfo.describe(base.specs(), payload), None

    def feedback(self, run_id: str, codec: CodecSpec) -> ErrorFeedback:
        """The error feedback of run ``run_id`` (loaded from ``state_dir`` when saved)."""
        if self._feedback is not None and self._feedback[0] == run_id:
            feedback = self._feedback[1]
            feedback.codec = codec.build()  # the server's settings may change on a restart
            return feedback
        path = None
        if self.state_dir is not None:
            folder = self.state_dir / FEEDBACK_FOLDER
            # The run id comes from the server: hashed, it is a safe file name.
            path = folder / f"{hashlib.sha256(run_id.encode()).hexdigest()[:32]}.npz"
            if folder.is_dir():
                for old in folder.glob("*.npz"):
                    if old != path:
                        old.unlink(missing_ok=True)
        feedback = ErrorFeedback(codec.build(), path)
        if feedback.residual:
            log.info("error feedback: read the residual saved in %s", path)
        self._feedback = (run_id, feedback)
        return feedback
