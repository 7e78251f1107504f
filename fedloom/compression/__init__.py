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

After any codec (or none), a lossless **zstd stage** may compress the payload's bytes
(``"q8+zstd"``, ``"zstd"`` alone: `split_stage`, `compress`, `ZstdReceiver`; needs the
optional zstandard package).

Each codec turns a tensor into fixed-layout parts (`Codec`, `encode`, `decode`,
`encoded_layout`), so an encoded update is an ordinary `Weights`; `DecodedWeights`
decodes one tensor per access, so a receiver never holds a whole decoded update. `ErrorFeedback`
carries what a lossy codec drops into the next update (for top-k). `make_codec` builds
one by name; a `CodecSpec` is a codec with its settings as the wire names it (what a
server grants and a header carries; see docs/compression.md)::

    >>> from fedloom.compression import make_codec
    >>> make_codec("q8", block=128)
    QuantizeCodec(bits=8, block=128)
"""

from __future__ import annotations

from fedloom.compression._base import (
    Codec,
    CompressionError,
    DecodedWeights,
    check_encoded,
    decode,
    encode,
    encoded_bytes,
    encoded_layout,
)
from fedloom.compression._cast import Bf16Codec, Fp16Codec
from fedloom.compression._feedback import ErrorFeedback
from fedloom.compression._quantize import QuantizeCodec
from fedloom.compression._spec import (
    CODECS,
    DOWNLOAD_CODECS,
    UPLOAD_CODECS,
    CodecSpec,
    choose,
    make_codec,
)
from fedloom.compression._topk import TopKCodec
from fedloom.compression._zstd import (
    ZstdReceiver,
    compress,
    require_zstd,
    split_stage,
    stage_name,
    stage_names,
)

__all__ = [
    "CODECS",
    "DOWNLOAD_CODECS",
    "UPLOAD_CODECS",
    "Bf16Codec",
    "Codec",
    "CodecSpec",
    "CompressionError",
    "DecodedWeights",
    "ErrorFeedback",
    "Fp16Codec",
    "QuantizeCodec",
    "TopKCodec",
    "ZstdReceiver",
    "check_encoded",
    "choose",
    "compress",
    "decode",
    "encode",
    "encoded_bytes",
    "encoded_layout",
    "make_codec",
    "require_zstd",
    "split_stage",
    "stage_name",
    "stage_names",
]
