"""Codecs by name, and `CodecSpec`: a codec and its settings as the wire names them.

The server fixes every setting (``[compression] quantize_block``, ``topk_fraction``);
a client only names the codecs it wants. A `CodecSpec` is what a Join grants and what
task and result headers carry: the same spec on both sides builds the same codec, so
both derive the same encoded layout (`fedloom.compression.encoded_layout`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from fedloom.compression._base import Codec, CompressionError
from fedloom.compression._cast import Bf16Codec, Fp16Codec
from fedloom.compression._quantize import DEFAULT_BLOCK, QuantizeCodec
from fedloom.compression._topk import TopKCodec

#: Codec names and what each accepts as settings.
CODECS: dict[str, tuple[str, ...]] = {
    "fp16": (),
    "bf16": (),
    "q8": ("block",),
    "q4": ("block",),
    "topk": ("fraction",),
}
#: Codecs for the broadcast of the global model. Quantizing the model's own values per
#: block, or keeping only its largest ones, would change the model itself, not round it.
DOWNLOAD_CODECS: tuple[str, ...] = ("fp16", "bf16")
#: Codecs for clients' updates (deltas).
UPLOAD_CODECS: tuple[str, ...] = tuple(CODECS)
DEFAULT_TOPK_FRACTION = 0.01


def make_codec(name: str, **settings: Any) -> Codec:
    """The codec called ``name`` with ``settings`` (`CODECS` lists both).

    Raises:
        CompressionError: an unknown name, or a setting it does not take.
    """
    if name not in CODECS:
        raise CompressionError(f"unknown codec {name!r}; one of {', '.join(CODECS)}")
    unknown = sorted(set(settings) - set(CODECS[name]))
    if unknown:
        takes = ", ".join(CODECS[name]) or "no settings"
        raise CompressionError(f"codec {name} does not take {unknown} (it takes {takes})")
    if name == "fp16":
        return Fp16Codec()
    if name == "bf16":
        return Bf16Codec()
    if name in ("q8", "q4"):
        return QuantizeCodec(bits=int(name[1]), **settings)
    return TopKCodec(**settings)


@dataclasses.dataclass(frozen=True, slots=True)
class CodecSpec:
    """A codec by name with the settings it takes (0 for a setting it does not take).

    >>> CodecSpec.of("q8", block=128, fraction=0.05)
    CodecSpec(name='q8', block=128, fraction=0.0)
    >>> CodecSpec.of("q8", block=128).build()
    QuantizeCodec(bits=8, block=128)
    """

    name: str
    block: int = 0  # q8, q4: values per scale
    fraction: float = 0.0  # topk: share of each tensor's values sent

    def __post_init__(self) -> None:
        self.build()  # refuses an unknown name or out-of-range settings

    @classmethod
    def of(cls, name: str, *, block: int = DEFAULT_BLOCK,
           fraction: float = DEFAULT_TOPK_FRACTION) -> CodecSpec:
        """The spec of ``name``, keeping only the settings it takes."""
        takes = CODECS.get(name, ())
        return cls(name, block if "block" in takes else 0,
                   fraction if "fraction" in takes else 0.0)

    def settings(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in CODECS.get(self.name, ())}

    def build(self) -> Codec:
        """The codec. Raises `CompressionError` for an unknown name or bad settings."""
        if self.name not in CODECS:
            raise CompressionError(f"unknown codec {self.name!r}; one of {', '.join(CODECS)}")
        takes = CODECS[self.name]
        if "block" not in takes and self.block:
            raise CompressionError(f"codec {self.name} takes no block")
        if "fraction" not in takes and self.fraction:
            raise CompressionError(f"codec {self.name} takes no fraction")
        if "fraction" in takes and not math.isfinite(self.fraction):
            raise CompressionError(f"the top-k fraction must be finite, got {self.fraction}")
        return make_codec(self.name, **self.settings())

    def __str__(self) -> str:
        settings = ", ".join(f"{k}={v:g}" for k, v in self.settings().items())
        return f"{self.name}({settings})" if settings else self.name


def choose(asked: Iterable[str], accepted: Iterable[str]) -> str | None:
    """The first name in ``asked`` (a client's order of preference) that ``accepted``
    holds, or None: names the receiver does not know are skipped, not refused, so a
    newer client may ask for codecs (or stages, ``"q8+zstd"``) an older server lacks."""
    accepted = set(accepted)
    return next((name for name in asked if name in accepted), None)
