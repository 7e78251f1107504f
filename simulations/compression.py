"""Compression in a simulation: what the wire's codecs do to a run, without the wire.

A scenario's ``[compression]`` table names one codec per direction, as a client asks
the server for them (docs/compression.md), with the server's settings::

    [compression]
    upload = "q8"          # "", "fp16", "bf16", "q8", "q4" or "topk"; "q8+zstd", "zstd", ...
    download = "fp16"      # "", "fp16" or "bf16"; "fp16+zstd", "zstd", ...
    quantize_block = 256   # q8, q4: values per scale
    topk_fraction = 0.01   # topk: share of each tensor's values sent

`SimulatedCompression` applies them where the deployed system does, with the same
codecs (`fedloom.compression`):

- **download**: every client of a round trains from the broadcast as decoded
  (``decode(encode(model))``), and its delta is taken against that decoded model, as
  the SDK does; the strategy adds the mean delta to its exact model;
- **upload**: each delta is encoded and decoded again before the strategy sees it;
  top-k goes through error feedback, one residual per client kept across rounds (the
  SDK's behaviour with a ``state_dir``). The stochastic rounding of q8/q4 draws from a
  generator seeded by (run seed, client, round), so every engine draws the same;
- **zstd** (a name ending in ``+zstd``, or ``"zstd"`` alone): lossless, so it changes
  nothing the strategy sees; the payloads are compressed for real (level 1, as the SDK
  and the server do) to count their bytes, and sent uncompressed when that is smaller.

Both engines apply it (the Flower bridge on the replies it receives: the same
arithmetic the client would do, since a simulated residual never leaves the process),
so the engines still agree round for round. Each round records the bytes a client
sends and receives (``upload_bytes_per_client``, ``download_bytes_per_client``: the
payloads' sizes as they travel, encoded or float32, compressed or not) in its fit metrics.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fedloom._compression_config import CompressionConfig
from fedloom.compression import (
    DOWNLOAD_CODECS,
    UPLOAD_CODECS,
    CodecSpec,
    ErrorFeedback,
    compress,
    decode,
    encode,
    require_zstd,
    split_stage,
    stage_names,
)
from fedloom.compression._quantize import DEFAULT_BLOCK
from fedloom.compression._spec import DEFAULT_TOPK_FRACTION
from fedloom.errors import ConfigError
from fedloom.payload import serialize
from fedloom.types import ClientUpdate, Metrics, Scalar
from fedloom.weights import TensorSpec, Weights

UPLOAD_BYTES = "upload_bytes_per_client"
DOWNLOAD_BYTES = "download_bytes_per_client"


@dataclasses.dataclass(frozen=True)
class CompressionSpec:
    """A scenario's ``[compression]``: one codec per direction ("" for none), each with
    or without the zstd stage."""

    upload: str = ""
    download: str = ""
    quantize_block: int = DEFAULT_BLOCK
    topk_fraction: float = DEFAULT_TOPK_FRACTION

    def __post_init__(self) -> None:
        for direction, allowed in (("upload", UPLOAD_CODECS), ("download", DOWNLOAD_CODECS)):
            name = getattr(self, direction)
            if name and name not in stage_names(allowed):
                hint = (" (quantizing or sparsifying the model itself would change it, "
                        "not round it: those codecs are for updates)"
                        if direction == "download" and split_stage(name)[0] in UPLOAD_CODECS
                        else "")
                raise ConfigError(f"compression.{direction}",
                                  f"{name!r} is not one of {', '.join(allowed)} (each may "
                                  f"end in +zstd, or zstd alone), or \"\" for none{hint}")
            require_zstd(f"compression.{direction}", [name])
        # The settings' ranges are the server's (the same names, the same messages).
        CompressionConfig(quantize_block=self.quantize_block, topk_fraction=self.topk_fraction)

    @property
    def enabled(self) -> bool:
        return bool(self.upload or self.download)

    def codec(self, name: str) -> CodecSpec | None:
        """The codec of ``name`` (None: none; the zstd stage is not a codec)."""
        codec, _ = split_stage(name)
        if not codec:
            return None
        return CodecSpec.of(codec, block=self.quantize_block, fraction=self.topk_fraction)


class SimulatedCompression:
    """The codecs of a `CompressionSpec` applied to one run (see the module docstring).

    Call `broadcast` once per round, then `update` for each client's delta; `traffic`
    gives the round's byte counts and starts the next round's.
    """

    def __init__(self, spec: CompressionSpec, base_seed: int = 0) -> None:
        self.spec = spec
        self.base_seed = base_seed
        self.upload = spec.codec(spec.upload)
        self.download = spec.codec(spec.download)
        self.upload_zstd = split_stage(spec.upload)[1]
        self.download_zstd = split_stage(spec.download)[1]
        self._feedback: dict[int, ErrorFeedback] = {}
        self._download_bytes = 0
        self._upload_bytes, self._uploads = 0, 0
        self._layout: tuple[tuple[TensorSpec, ...], int] = ((), 0)  # last layout, its bytes

    def broadcast(self, weights: Weights) -> Weights:
        """The model every client of the round receives (decoded)."""
        if self.download is None:
            self._download_bytes = _sent_bytes(weights, self.download_zstd)
            return weights
        codec = self.download.build()
        encoded = encode(codec, weights, np.random.default_rng(0))  # casts draw nothing
        self._download_bytes = _sent_bytes(encoded, self.download_zstd)
        return decode(codec, weights.specs(), encoded)

    def update(self, update: ClientUpdate, client_index: int, server_round: int
               ) -> ClientUpdate:
        """``update`` (a delta from the broadcast) as the server decodes it."""
        if self.upload is None:
            self._count_upload(_sent_bytes(update.delta, True) if self.upload_zstd
                               else self._plain_bytes(update.delta))
            return update
        rng = np.random.default_rng([self.base_seed, client_index, server_round])
        if self.upload.name == "topk":
            feedback = self._feedback.get(client_index)
            if feedback is None:
                feedback = self._feedback[client_index] = ErrorFeedback(self.upload.build())
            encoded = feedback.encode(update.delta, rng)
            codec = feedback.codec
        else:
            codec = self.upload.build()
            encoded = encode(codec, update.delta, rng)
        self._count_upload(_sent_bytes(encoded, self.upload_zstd))
        delta = decode(codec, update.delta.specs(), encoded)
        return dataclasses.replace(update, delta=delta)

    def traffic(self) -> Metrics:
        """The round's bytes per client, each way; resets the counts."""
        metrics: dict[str, Scalar] = {DOWNLOAD_BYTES: self._download_bytes}
        if self._uploads:
            metrics[UPLOAD_BYTES] = self._upload_bytes / self._uploads
        self._upload_bytes, self._uploads = 0, 0
        return metrics

    def _count_upload(self, nbytes: int) -> None:
        self._upload_bytes += nbytes
        self._uploads += 1

    def _plain_bytes(self, weights: Weights) -> int:
        """``weights.nbytes``, summed once per layout object (rows of one stack share
        theirs)."""
        specs = weights.specs()
        if specs is not self._layout[0]:
            self._layout = (specs, sum(spec.nbytes for spec in specs))
        return self._layout[1]


def _sent_bytes(weights: Weights, zstd: bool) -> int:
    """The bytes ``weights`` travel as: its payload, or its zstd frame when the stage is
    on and the frame is smaller (as the SDK and the server send it)."""
    if not zstd:
        return weights.nbytes
    payload = serialize(weights)
    frame = compress(payload)
    return len(frame) if frame is not None else len(payload)
