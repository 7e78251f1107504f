"""Tensor payloads: layout, chunking, digest and hostile chunk streams."""

from __future__ import annotations

import io

import numpy as np
import pytest

from fedloom import SUPPORTED_DTYPES, MessageRejectedError, Weights
from fedloom.payload import PayloadInfo, PayloadReceiver, deserialize, iter_chunks, serialize
from fedloom.protos import codec


def _every_dtype() -> Weights:
    rng = np.random.default_rng(0)
    tensors = {}
    for name, dtype in SUPPORTED_DTYPES.items():
        if dtype.kind == "b":
            arr = rng.integers(0, 2, size=(3, 2)).astype(bool)
        elif dtype.kind in "iu":
            info = np.iinfo(dtype)
            arr = rng.integers(info.min, info.max, size=(2, 3), dtype=dtype, endpoint=True)
        else:
            arr = rng.normal(size=(5,)).astype(dtype)
        tensors[name] = arr
    tensors["scalar"] = np.array(3.5, np.float32)
    tensors["empty"] = np.zeros((0, 7), np.float64)
    return Weights(tensors)


def _receive(info: PayloadInfo, pieces, max_chunk=1 << 20) -> bytes:
    sink = io.BytesIO()
    receiver = PayloadReceiver(
        info.specs, info.total_bytes, info.sha256, sink, max_chunk_bytes=max_chunk
    )
    for offset, data in pieces:
        receiver.feed(offset, data)
    receiver.finish()
    return sink.getvalue()


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64, 1 << 20])
def test_round_trip_every_dtype_through_codec_and_chunks(chunk_size: int) -> None:
    weights = _every_dtype()
    payload = serialize(weights)
    info = PayloadInfo.describe(weights.specs(), payload)
    wire_info = codec.payload_from_proto(codec.payload_to_proto(info))
    assert wire_info == info
    received = _receive(wire_info, iter_chunks(payload, chunk_size))
    back = deserialize(wire_info.specs, received)
    assert list(back) == list(weights)
    for name in weights:
        assert back[name].dtype == weights[name].dtype
        assert back[name].shape == weights[name].shape
        np.testing.assert_array_equal(back[name], weights[name])


def test_big_endian_input_travels_little_endian() -> None:
    arr = np.arange(4, dtype=">i4")
    payload = serialize(Weights({"x": arr}))
    assert bytes(payload) == np.arange(4, dtype="<i4").tobytes()


def test_digest_mismatch_is_rejected() -> None:
    weights = Weights({"x": np.arange(10, dtype=np.float32)})
    payload = bytearray(serialize(weights))
    info = PayloadInfo.describe(weights.specs(), payload)
    payload[5] ^= 0xFF
    with pytest.raises(MessageRejectedError, match="digest"):
        _receive(info, iter_chunks(payload, 8))


@pytest.mark.parametrize("case", ["gap", "overlap", "extra", "short", "oversized", "empty"])
def test_bad_chunk_streams_are_rejected(case: str) -> None:
    weights = Weights({"x": np.arange(16, dtype=np.float32)})
    payload = bytes(serialize(weights))
    info = PayloadInfo.describe(weights.specs(), payload)
    pieces = list(iter_chunks(payload, 16))
    if case == "gap":
        pieces = [pieces[0], pieces[2]]
    elif case == "overlap":
        pieces = [pieces[0], (8, payload[8:24])]
    elif case == "extra":
        pieces = [*pieces, (64, b"x")]
    elif case == "short":
        pieces = pieces[:-1]
    elif case == "oversized":
        pieces = [(0, payload)]
    elif case == "empty":
        pieces = [(0, b""), *pieces]
    with pytest.raises(MessageRejectedError):
        _receive(info, pieces, max_chunk=16)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("chunk_size", [3, 5, 64])
def test_non_finite_values_are_rejected_even_split_across_chunks(
    bad: float, chunk_size: int
) -> None:
    arr = np.arange(12, dtype=np.float32)
    arr[7] = bad
    weights = Weights({"ints": np.arange(3, dtype=np.int64), "x": arr})
    payload = serialize(weights)
    info = PayloadInfo.describe(weights.specs(), payload)
    with pytest.raises(MessageRejectedError, match="NaN or Inf"):
        _receive(info, iter_chunks(payload, chunk_size))


def test_header_lying_about_size_is_rejected() -> None:
    weights = Weights({"x": np.zeros(4, np.float32)})
    proto = codec.payload_to_proto(PayloadInfo.describe(weights.specs(), serialize(weights)))
    proto.total_bytes = 1 << 40
    with pytest.raises(MessageRejectedError, match="tensors need"):
        codec.payload_from_proto(proto)


def test_unknown_dtype_and_duplicate_names_are_rejected() -> None:
    weights = Weights({"x": np.zeros(4, np.float32)})
    proto = codec.payload_to_proto(PayloadInfo.describe(weights.specs(), serialize(weights)))
    proto.tensors[0].dtype = "object"
    with pytest.raises(MessageRejectedError, match="dtype"):
        codec.payload_from_proto(proto)
    proto.tensors[0].dtype = "float32"
    proto.tensors.append(proto.tensors[0])
    with pytest.raises(MessageRejectedError, match="twice"):
        codec.payload_from_proto(proto)
