"""Tensor payloads: layout, chunking, digest and hostile chunk streams."""

from __future__ import annotations

import io

import numpy as np
import pytest

from fedloom import SUPPORTED_DTYPES, MessageRejectedError, RejectReason, Weights
from fedloom.payload import (
    PayloadInfo,
    PayloadReceiver,
    deserialize,
    iter_chunk_views,
    iter_chunks,
    serialize,
)
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


# -- the refusals, each with its reason and message ---------------------------------
def _sixteen_floats() -> tuple[PayloadInfo, bytes]:
    weights = Weights({"x": np.arange(16, dtype=np.float32)})
    payload = bytes(serialize(weights))
    return PayloadInfo.describe(weights.specs(), payload), payload  # 64 bytes


def _refusal(call) -> tuple[RejectReason, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(MessageRejectedError) as info:
        call()
    return info.value.reason, str(info.value)


def test_deserialize_refuses_a_payload_of_another_size() -> None:
    info, payload = _sixteen_floats()
    assert _refusal(lambda: deserialize(info.specs, payload[:-1])) == (
        RejectReason.INVALID, "payload is 63 bytes, layout needs 64"
    )


def test_receiver_refuses_a_header_that_contradicts_its_layout() -> None:
    info, _ = _sixteen_floats()
    sink = io.BytesIO()

    def receiver(total: int, sha256: bytes) -> PayloadReceiver:
        return PayloadReceiver(info.specs, total, sha256, sink, max_chunk_bytes=16)

    assert _refusal(lambda: receiver(65, info.sha256)) == (
        RejectReason.INVALID, "header declares 65 bytes but its layout needs 64"
    )
    assert _refusal(lambda: receiver(64, info.sha256[:31])) == (
        RejectReason.INVALID, "sha256 digest must be 32 bytes"
    )


@pytest.mark.parametrize(
    ("sent", "bad", "message"),
    [
        (0, (8, b"x" * 8), "chunk at offset 8 arrived, expected offset 0"),
        (32, (32, b""), "chunk of 0 bytes; chunks must hold 1..16 bytes"),
        (32, (32, b"x" * 17), "chunk of 17 bytes; chunks must hold 1..16 bytes"),
        # 56 + 9 > 64: refused as it arrives, not only when the stream ends
        (56, (56, b"x" * 9), "payload exceeds the 64 bytes its header declares"),
        (64, (64, b"x"), "payload exceeds the 64 bytes its header declares"),
    ],
)
def test_a_bad_chunk_is_refused_and_nothing_of_it_is_written(
    sent: int, bad: tuple[int, bytes], message: str
) -> None:
    info, payload = _sixteen_floats()
    sink = io.BytesIO()
    receiver = PayloadReceiver(info.specs, 64, info.sha256, sink, max_chunk_bytes=16)
    for offset, data in iter_chunks(payload[:sent], 16):
        receiver.feed(offset, data)
    assert _refusal(lambda: receiver.feed(*bad)) == (RejectReason.INVALID, message)
    assert sink.getvalue() == payload[:sent] and receiver.received == sent


def test_a_short_or_altered_stream_is_refused_at_finish() -> None:
    info, payload = _sixteen_floats()
    short = PayloadReceiver(info.specs, 64, info.sha256, io.BytesIO(), max_chunk_bytes=64)
    short.feed(0, payload[:48])
    assert _refusal(short.finish) == (
        RejectReason.INVALID, "stream ended after 48 of 64 payload bytes"
    )
    altered = PayloadReceiver(info.specs, 64, info.sha256, io.BytesIO(), max_chunk_bytes=64)
    altered.feed(0, payload[:-1] + bytes([payload[-1] ^ 1]))
    assert _refusal(altered.finish) == (RejectReason.INVALID, "payload SHA-256 digest mismatch")


def test_a_non_finite_value_is_refused_as_invalid() -> None:
    weights = Weights({"ok": np.zeros(2, np.float64), "w": np.array([1.0, np.nan], np.float32)})
    payload = serialize(weights)
    info = PayloadInfo.describe(weights.specs(), payload)
    assert _refusal(lambda: _receive(info, iter_chunks(payload, 5))) == (
        RejectReason.INVALID, "tensor 'w' holds NaN or Inf"
    )


def test_a_chunk_of_exactly_the_largest_size_is_taken() -> None:
    info, payload = _sixteen_floats()
    assert _receive(info, iter_chunks(payload, 16), max_chunk=16) == payload


@pytest.mark.parametrize("chunk_size", [1, 3, 5, 8, 13, 64])
def test_only_floating_tensors_are_checked_for_nan(chunk_size: int) -> None:
    # Bit patterns that read as NaN / Inf / NaN in float32, held by an int32 and a
    # uint8 tensor right after a float tensor that ends inside a chunk: valid values.
    ints = np.array([0x7FC00000, 0x7F800000, -1], dtype=np.int32)
    weights = Weights({
        "f": np.arange(3, dtype=np.float32),
        "i": ints,
        "u": np.full(8, 0xFF, dtype=np.uint8),
        "g": np.array([0.5, -2.0], dtype=np.float64),
    })
    payload = bytes(serialize(weights))
    info = PayloadInfo.describe(weights.specs(), payload)
    assert _receive(info, iter_chunks(payload, chunk_size)) == payload


@pytest.mark.parametrize("payload", [b"", b"abc"])
@pytest.mark.parametrize("chunk_size", [0, -1])
def test_chunk_size_must_be_positive(payload: bytes, chunk_size: int) -> None:
    with pytest.raises(ValueError, match=r"^chunk_size must be positive$"):
        list(iter_chunks(payload, chunk_size))


def test_chunk_views_are_the_payload_bytes_in_order() -> None:
    payload = bytes(range(256))
    views = list(iter_chunk_views(payload, 100))
    assert [offset for offset, _ in views] == [0, 100, 200]
    for offset, view in views:
        # unsigned bytes, as the payload holds them (0xFF is 255, not -1)
        assert view.tolist() == list(payload[offset : offset + 100])
        assert view == memoryview(payload)[offset : offset + 100]
