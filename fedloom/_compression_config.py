"""`CompressionConfig`: the ``[compression]`` settings, the codecs a server accepts.

.. code-block:: toml

    [compression]
    upload = ["q8+zstd", "q8", "topk"]   # codecs clients may encode their updates with
    download = ["fp16"]         # codecs the server may broadcast the model with
    quantize_block = 256        # q8, q4: values per scale
    topk_fraction = 0.01        # topk: share of each tensor's values sent

The server fixes every codec setting; a client names the codecs it wants at Join, in
order of preference, and is granted the first the server accepts (or none: it then
sends and receives plain float32, as a client that asks nothing does). A name with the
``+zstd`` suffix (or ``"zstd"`` alone, for plain float32) adds the lossless zstd stage
after the codec; it needs the zstandard package (``pip install 'fedloom[zstd]'``),
checked here. Nothing is accepted by default. docs/compression.md says what each costs
and saves.
"""

from __future__ import annotations

import dataclasses
import math

from fedloom.compression import (
    DOWNLOAD_CODECS,
    UPLOAD_CODECS,
    CodecSpec,
    require_zstd,
    split_stage,
    stage_names,
)
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
        (), f"codecs clients may send updates in ({', '.join(UPLOAD_CODECS)}; each may "
            "end in +zstd, and zstd alone compresses plain float32); empty: plain float32 "
            "only")
    download: tuple[str, ...] = described(
        (), f"codecs the model may be broadcast in ({', '.join(DOWNLOAD_CODECS)}, with "
            "or without +zstd, or zstd); empty: plain float32 only")
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
                check(name in stage_names(allowed), _setting(direction),
                      _unknown(direction, name, allowed))
            check(len(set(names)) == len(names), _setting(direction),
                  f"names a codec twice: {list(names)}")
            require_zstd(_setting(direction), names)
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
        """The codecs ``upload`` names (with or without the zstd stage), once each."""
        return _specs(self, self.upload)

    @property
    def download_specs(self) -> tuple[CodecSpec, ...]:
        return _specs(self, self.download)


def _specs(config: CompressionConfig, names: tuple[str, ...]) -> tuple[CodecSpec, ...]:
    codecs = dict.fromkeys(split_stage(name)[0] for name in names)
    return tuple(config.spec(codec) for codec in codecs if codec)


def _unknown(direction: str, name: str, allowed: tuple[str, ...]) -> str:
    codec, _ = split_stage(name)
    if direction == "download" and codec in UPLOAD_CODECS:
        return (f"{name!r} is for updates only: quantizing the model per block or keeping "
                "only its largest values changes the model clients train, not just its "
                f"precision; use one of {', '.join(map(repr, allowed))}, or list {name!r} "
                "under compression.upload")
    return (f"unknown codec {name!r}; one of {', '.join(map(repr, allowed))}, each may end "
            "in '+zstd', or 'zstd' alone")


def check_compression(compression: CompressionConfig, *, secure: bool) -> None:
    """What compression cannot be combined with (SecAgg+), and why: checked where the
    server's whole configuration is known (`fedloom.config.ServerConfig`)."""
    if not secure:
        return
    zstd = any(split_stage(name)[1] for name in (*compression.upload, *compression.download))
    check(not zstd, _setting("upload" if any(split_stage(n)[1] for n in compression.upload)
                             else "download"),
          "the zstd stage cannot be used with secure aggregation: masked inputs are uniformly "
          "random (zstd cannot shrink them), and a secure round's tasks carry the model "
          "unencoded; drop the zstd names from the [compression] table")
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
