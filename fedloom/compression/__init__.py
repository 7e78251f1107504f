"""Update and broadcast compression: codecs that cut the bytes a model moves.

=========  ===========================================  =====================  =========
codec      what is sent                                 bytes per float32      unbiased
=========  ===========================================  =====================  =========
``fp16``   IEEE half precision                          2                      no
``bf16``   bfloat16 (float32's range, 8 bits)           2                      no
``q8``     8-bit stochastic codes + a scale per block   1 + 4 / block          yes
``q4``     4-bit stochastic codes + a scale per block   0.5 + 4 / block        yes
``topk``   the largest ``fraction`` of each tensor      8 * fraction           no
=========  ===========================================  =====================  =========

Each codec turns a tensor into fixed-layout parts (`Codec`, `encode`, `decode`,
`encoded_layout`), so an encoded update is an ordinary `Weights`; `DecodedWeights`
decodes one tensor per access, so a receiver never holds a whole decoded update. `ErrorFeedback`
carries what a lossy codec drops into the next update (for top-k). `make_codec` builds
one by name::

    >>> from fedloom.compression import make_codec
    >>> make_codec("q8", block=128)
    QuantizeCodec(bits=8, block=128)
"""

from __future__ import annotations

from typing import Any

from fedloom.compression._base import (
    Codec,
    CompressionError,
    DecodedWeights,
    decode,
    encode,
    encoded_bytes,
    encoded_layout,
)
from fedloom.compression._cast import Bf16Codec, Fp16Codec
from fedloom.compression._feedback import ErrorFeedback
from fedloom.compression._quantize import QuantizeCodec
from fedloom.compression._topk import TopKCodec

#: Codec names and what each accepts as settings.
CODECS: dict[str, tuple[str, ...]] = {
    "fp16": (),
    "bf16": (),
    "q8": ("block",),
    "q4": ("block",),
    "topk": ("fraction",),
}


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


__all__ = [
    "CODECS",
    "Bf16Codec",
    "Codec",
    "CompressionError",
    "DecodedWeights",
    "ErrorFeedback",
    "Fp16Codec",
    "QuantizeCodec",
    "TopKCodec",
    "decode",
    "encode",
    "encoded_bytes",
    "encoded_layout",
    "make_codec",
]
