"""The edges of what a receiver refuses in a client's encoded bytes, one case each.

The property tests (`test_check_encoded.py`) compare the checks with the decoders over
random parts; these pin the boundary cases a random draw can miss (an index just past
the tensor, a code of -8 in a high nibble only, a stream one byte too long) and the
message each refusal gives, since the message is what the sender's operator reads.
"""

from __future__ import annotations

import numpy as np
import pytest
import zstandard

from fedloom.compression import CompressionError, ZstdReceiver, make_codec
from fedloom.compression._zstd import PIECE_BYTES
from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.payload import PayloadInfo, PayloadReceiver, serialize
from fedloom.weights import TensorSpec, Weights

DTYPES = ("float16", "float32", "float64")


def _refused(codec_name: str, parts: list[np.ndarray], spec: TensorSpec, match: str,
             **settings: object) -> None:
    """Both the decoder and the receiver's check refuse, with the same message."""
    codec = make_codec(codec_name, **settings)
    with pytest.raises(CompressionError, match=match):
        codec.decode_tensor(parts, spec)
    with pytest.raises(CompressionError, match=match):
        codec.check_tensor(parts, spec)


# -- top-k ----------------------------------------------------------------------------
def test_topk_refuses_an_index_one_past_the_tensor() -> None:
    spec = TensorSpec("w", "float32", (8,))
    index, values = np.array([2, 8], np.uint32), np.array([1.0, 2.0], np.float32)
    _refused("topk", [index, values], spec, r"strictly increasing and below 8",
             fraction=0.25)
    # and the last index inside the tensor is fine
    make_codec("topk", fraction=0.25).check_tensor([np.array([2, 7], np.uint32), values], spec)


def test_topk_refuses_repeated_indices_and_names_non_finite_values() -> None:
    spec = TensorSpec("w", "float32", (8,))
    _refused("topk", [np.array([3, 3], np.uint32), np.ones(2, np.float32)], spec,
             r"strictly increasing", fraction=0.25)
    codec = make_codec("topk", fraction=0.25)
    big = np.array([1.0, 7e4], np.float32)  # finite in float32, inf in float16
    with pytest.raises(CompressionError, match=r"'w' decodes to non-finite values"):
        codec.check_tensor([np.array([0, 1], np.uint32), big], TensorSpec("w", "float16", (8,)))


# -- q4 and q8 ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [4, 6, 7])
def test_q4_refuses_a_code_of_minus_8_in_any_nibble(size: int, dtype: str) -> None:
    spec = TensorSpec("w", dtype, (size,))
    scales = np.ones(2, np.float32)
    honest = np.full((size + 1) // 2, 0x88, np.uint8)  # every code 0
    make_codec("q4", block=4).check_tensor([scales, honest], spec)
    for byte in range(size // 2):  # the full bytes: low nibble, then high nibble
        for bad in (0x80, 0x08):
            packed = honest.copy()
            packed[byte] = bad
            _refused("q4", [scales, packed], spec, r"must lie in \[-7, 7\]", block=4)


def test_q4_refuses_a_padding_nibble_that_is_not_zero() -> None:
    spec = TensorSpec("w", "float32", (5,))
    packed = np.array([0x88, 0x88, 0x98], np.uint8)  # the last high nibble is padding
    _refused("q4", [np.ones(2, np.float32), packed], spec,
             "^the padding nibble of a 4-bit payload must encode 0$", block=4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_q8_refuses_minus_128_and_bad_scales_by_name(dtype: str) -> None:
    spec = TensorSpec("layer.w", dtype, (4,))
    codes = np.array([1, -127, 127, 0], np.int8)
    make_codec("q8", block=4).check_tensor([np.ones(1, np.float32), codes], spec)
    _refused("q8", [np.ones(1, np.float32), np.array([1, -128, 0, 0], np.int8)], spec,
             r"codes of 'layer.w' must lie in \[-127, 127\]", block=4)
    for scale in (-1.0, np.inf, np.nan):
        _refused("q8", [np.array([scale], np.float32), codes], spec,
                 r"scales of 'layer.w' must be finite and >= 0", block=4)


# -- casts ------------------------------------------------------------------------------
def test_bf16_and_fp16_name_the_tensor_whose_part_is_not_finite() -> None:
    spec = TensorSpec("head", "float32", (2,))
    _refused("bf16", [np.array([0x3F80, 0x7F80], np.uint16)], spec,
             r"part of 'head' holds non-finite values")
    _refused("fp16", [np.array([1.0, np.inf], np.float16)], spec,
             r"part of 'head' holds non-finite values")


@pytest.mark.parametrize("name", ["fp16", "bf16", "q8", "q4", "topk"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decoded_tensor_has_its_own_dtype(name: str, dtype: str) -> None:
    codec = make_codec(name)
    spec = TensorSpec("w", dtype, (300,))
    if not codec.applies(spec):
        return
    values = np.linspace(-1, 1, 300).astype(dtype)
    parts = codec.encode_tensor(values, spec, np.random.default_rng(0))
    decoded = codec.decode_tensor(list(parts), spec)
    assert decoded.dtype == np.dtype(dtype) and decoded.shape == (300,)


# -- the zstd stream ----------------------------------------------------------------------
def _stream() -> tuple[PayloadInfo, bytes]:
    weights = Weights({"w": np.zeros(4096, np.float32)})
    payload = bytes(serialize(weights))
    return PayloadInfo.describe(weights.specs(), payload), zstandard.ZstdCompressor(
        level=1).compress(payload)


class _Sink:
    def write(self, data: bytes) -> None:
        pass


def _receiver(info: PayloadInfo, wire_bytes: int, chunk: int = 16) -> ZstdReceiver:
    inner = PayloadReceiver(info.specs, info.total_bytes, info.sha256, _Sink(),
                            max_chunk_bytes=PIECE_BYTES)
    return ZstdReceiver(inner, wire_bytes, max_chunk_bytes=chunk)


def _invalid(match: str, fn, *args) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MessageRejectedError, match=match) as info:
        fn(*args)
    assert info.value.reason is RejectReason.INVALID


def test_the_stream_refuses_empty_oversized_and_out_of_order_chunks() -> None:
    info, stream = _stream()
    receiver = _receiver(info, len(stream))
    _invalid(r"chunk of 0 bytes; chunks must hold 1..16 bytes", receiver.feed, 0, b"")
    _invalid(r"chunk of 17 bytes; chunks must hold 1..16 bytes", receiver.feed, 0,
             stream[:17])
    receiver.feed(0, stream[:1])  # a chunk of one byte is a chunk
    _invalid(r"offset 5 of the zstd stream arrived, expected offset 1", receiver.feed, 5,
             stream[5:6])


def test_the_stream_refuses_a_byte_past_wire_bytes_and_a_stream_that_ends_early() -> None:
    info, stream = _stream()
    receiver = _receiver(info, len(stream) - 1, chunk=len(stream))
    _invalid(rf"exceeds the {len(stream) - 1} bytes \(wire_bytes\) its header declares",
             receiver.feed, 0, stream)
    early = _receiver(info, len(stream), chunk=len(stream))
    early.feed(0, stream[:-1])
    _invalid(rf"ended after {len(stream) - 1} of {len(stream)} bytes", early.finish)
    whole = _receiver(info, len(stream), chunk=len(stream))
    whole.feed(0, stream)
    whole.finish()
