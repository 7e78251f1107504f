"""`CompressionConfig`: the ``[compression]`` settings, the codecs a server accepts.

.. code-block:: toml

    [compression]
    upload = ["q8", "topk"]     # codecs clients may encode their updates with
    download = ["fp16"]         # codecs the server may broadcast the model with
    quantize_block = 256        # q8, q4: values per scale
    topk_fraction = 0.01        # topk: share of each tensor's values sent

The server fixes every codec setting; a client names the codecs it wants at Join, in
order of preference, and is granted the first the server accepts (or none: it then
sends and receives plain float32, as a client that asks nothing does). Nothing is
accepted by default. docs/compression.md says what each codec costs and saves.
"""

from __future__ import annotations

import dataclasses
import math

from fedloom.compression import DOWNLOAD_CODECS, UPLOAD_CODECS, CodecSpec
from fedloom.compression._quantize import DEFAULT_BLOCK
from fedloom.compression._spec import DEFAULT_TOPK_FRACTION
from fedloom.settings import check, described

SECTION = "compression"
MAX_BLOCK = 1 << 20


def _setting(name: str) -> str:
    return f"{SECTION}.{name}"


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
    """Which codecs clients may use, per direction, and their settings (server-fixed)."""

    upload: tuple[str, ...] = described(
        (), f"codecs clients may send updates in ({', '.join(UPLOAD_CODECS)}); "
            "empty: plain float32 only")
    download: tuple[str, ...] = described(
        (), f"codecs the model may be broadcast in ({', '.join(DOWNLOAD_CODECS)}); "
            "empty: plain float32 only")
    quantize_block: int = described(DEFAULT_BLOCK, "q8, q4: values sharing one scale")
    topk_fraction: float = described(DEFAULT_TOPK_FRACTION,
                                     "topk: share of each tensor's values a client sends, "
                                     "in (0, 1]")

    def __post_init__(self) -> None:
        for direction, allowed in (("upload", UPLOAD_CODECS), ("download", DOWNLOAD_CODECS)):
            names = getattr(self, direction)
            check(isinstance(names, list | tuple) and all(isinstance(n, str) for n in names),
                  _setting(direction), "must be a list of codec names")
            object.__setattr__(self, direction, tuple(names))
            for name in names:
                check(name in allowed, _setting(direction), _unknown(direction, name, allowed))
            check(len(set(names)) == len(names), _setting(direction),
                  f"names a codec twice: {list(names)}")
        check(isinstance(self.quantize_block, int) and not isinstance(self.quantize_block, bool)
              and 1 <= self.quantize_block <= MAX_BLOCK, _setting("quantize_block"),
              f"must be an integer from 1 to {MAX_BLOCK}, got {self.quantize_block!r} "
              f"(the default {DEFAULT_BLOCK} adds 4 bytes of scale per {DEFAULT_BLOCK} values)")
        check(math.isfinite(self.topk_fraction) and 0.0 < self.topk_fraction <= 1.0,
              _setting("topk_fraction"),
              f"must be in (0, 1], got {self.topk_fraction!r} (0.01 sends 1% of each tensor)")

    @property
    def enabled(self) -> bool:
        """Whether any codec is accepted, in either direction."""
        return bool(self.upload or self.download)

    def spec(self, name: str) -> CodecSpec:
        """The codec ``name`` with this server's settings."""
        return CodecSpec.of(name, block=self.quantize_block, fraction=self.topk_fraction)

    @property
    def upload_specs(self) -> tuple[CodecSpec, ...]:
        return tuple(self.spec(name) for name in self.upload)

    @property
    def download_specs(self) -> tuple[CodecSpec, ...]:
        return tuple(self.spec(name) for name in self.download)


def _unknown(direction: str, name: str, allowed: tuple[str, ...]) -> str:
    if direction == "download" and name in UPLOAD_CODECS:
        return (f"{name!r} is for updates only: quantizing the model per block or keeping "
                "only its largest values changes the model clients train, not just its "
                f"precision; use one of {', '.join(map(repr, allowed))}, or list {name!r} "
                "under compression.upload")
    return f"unknown codec {name!r}; one of {', '.join(map(repr, allowed))}"


def check_compression(compression: CompressionConfig, *, secure: bool) -> None:
    """What compression cannot be combined with (SecAgg+), and why: checked where the
    server's whole configuration is known (`fedloom.config.ServerConfig`)."""
    if not secure:
        return
    check(not compression.upload, _setting("upload"),
          "cannot be used with secure aggregation: SecAgg+ already clips and quantizes each "
          "update into its own field (secure_aggregation.bits) before masking, and a lossy "
          "codec does not commute with the masks (the server would have to decode each "
          "client's update, which it must never see). Lower secure_aggregation.bits to send "
          "fewer bytes, or set compression.upload = []")
    check(not compression.download, _setting("download"),
          "cannot be used with secure aggregation: the SecAgg+ setup binds one model digest "
          "for every participant (model_digest, over the bytes each downloads), so every "
          "participant must receive the same payload; set compression.download = [] or "
          "secure_aggregation.enabled = false")
