"""The committed conformance vectors (protos/conformance/vectors.json) are what fedloom's
code makes now, and they say what their descriptions say, checked here with plain
numpy, hashlib and a hand-written protobuf encoder of `Value`."""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from typing import Any

import numpy as np
import pytest
from google.protobuf.json_format import MessageToDict

from fedloom.protos.conformance.generate import VECTORS_PATH, build_vectors, render
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb

VECTORS = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))

#: The wire dtypes as the protocol states them, independently of fedloom.weights.
DTYPES = {"bool": "|b1", "int8": "|i1", "uint8": "|u1", "int16": "<i2", "uint16": "<u2",
          "int32": "<i4", "uint32": "<u4", "int64": "<i8", "uint64": "<u8",
          "float16": "<f2", "float32": "<f4", "float64": "<f8"}


def array(tensor: dict[str, Any]) -> np.ndarray:
    return np.array(tensor["values"], DTYPES[tensor["dtype"]]).reshape(tensor["shape"])


def unbase64(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


def test_committed_vectors_are_what_the_code_makes_now() -> None:
    assert VECTORS_PATH.read_text(encoding="utf-8") == render(build_vectors()), (
        "protos/conformance/vectors.json is stale: run "
        "`python -m fedloom.protos.conformance.generate` and commit it")


def test_vectors_stay_commit_sized() -> None:
    assert VECTORS_PATH.stat().st_size < 100_000


@pytest.mark.parametrize("vector", VECTORS["payloads"], ids=lambda v: v["description"][:30])
def test_payload_is_the_tensors_bytes_in_order_and_the_digest_is_their_sha256(
        vector: dict[str, Any]) -> None:
    tensors = vector["tensors"]
    raw = [array(t).tobytes() for t in tensors]
    assert [unbase64(t["data_base64"]) for t in tensors] == raw
    payload = b"".join(raw)
    header = vector["header"]
    assert header["tensors"] == [{k: t[k] for k in ("name", "dtype", "shape")} for t in tensors]
    assert header["total_bytes"] == len(payload)
    assert header["sha256"] == hashlib.sha256(payload).hexdigest()
    assert b"".join(unbase64(c["data_base64"]) for c in vector["chunks"]) == payload
    parsed = pb.PayloadHeader.FromString(unbase64(vector["header_base64"]))
    assert parsed.total_bytes == len(payload)
    assert parsed.sha256 == hashlib.sha256(payload).digest()
    assert [(s.name, s.dtype, list(s.shape)) for s in parsed.tensors] == [
        (t["name"], t["dtype"], t["shape"]) for t in tensors]


@pytest.mark.parametrize("vector", VECTORS["payloads"], ids=lambda v: v["description"][:30])
def test_chunks_are_contiguous_from_zero_and_full_but_the_last(vector: dict[str, Any]) -> None:
    size, chunks = vector["chunk_size"], vector["chunks"]
    lengths = [len(unbase64(c["data_base64"])) for c in chunks]
    assert [c["offset"] for c in chunks] == [sum(lengths[:i]) for i in range(len(chunks))]
    assert all(n == size for n in lengths[:-1])
    assert all(0 < n <= size for n in lengths[-1:])
    assert sum(lengths) == vector["header"]["total_bytes"]  # none at all for 0 bytes


def numpy_fedavg(vector: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The arithmetic the descriptions state: a float64 weighted sum, one division,
    rounded to each tensor's dtype (integers half to even), added in that dtype."""
    weights = [u["num_examples"] for u in vector["updates"]]
    means, news = {}, {}
    for index, tensor in enumerate(vector["global"]):
        current = array(tensor)
        deltas = [array(u["delta"][index]).astype(np.float64) for u in vector["updates"]]
        mean64 = sum(n * d for n, d in zip(weights, deltas, strict=True)) / sum(weights)
        if current.dtype.kind in "iu":
            mean = np.rint(mean64).astype(current.dtype)
        else:
            mean = np.asarray(mean64).astype(current.dtype)
        means[tensor["name"]], news[tensor["name"]] = mean, current + mean
    return means, news


@pytest.mark.parametrize("vector", VECTORS["fedavg"], ids=lambda v: v["description"][:30])
def test_fedavg_vectors_equal_a_numpy_reference_bit_for_bit(vector: dict[str, Any]) -> None:
    means, news = numpy_fedavg(vector)
    for key, expected in (("mean_delta", means), ("new_global", news)):
        got = {t["name"]: array(t) for t in vector[key]}
        assert list(got) == [t["name"] for t in vector["global"]]
        for name, value in got.items():
            assert value.dtype == expected[name].dtype
            assert value.tobytes() == expected[name].tobytes(), (key, name)


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def encode_value(fields: dict[str, Any]) -> bytes:
    """protobuf's encoding of a `Value`, by hand: the one oneof member that is set."""
    ((kind, value),) = fields.items()
    if kind == "bool_value":
        return b"\x08" + bytes([value])
    if kind == "int_value":  # sint64: zigzag, then varint
        number = int(value)
        return b"\x10" + varint(((number << 1) ^ (number >> 63)) & (2**64 - 1))
    if kind == "float_value":
        return b"\x19" + struct.pack("<d", value)
    data = value.encode() if kind == "string_value" else unbase64(value)
    return (b"\x22" if kind == "string_value" else b"\x2a") + varint(len(data)) + data


@pytest.mark.parametrize("vector", VECTORS["values"], ids=lambda v: v["description"][:30])
def test_value_encodings_match_a_hand_written_encoder(vector: dict[str, Any]) -> None:
    assert unbase64(vector["encoding_base64"]) == encode_value(vector["fields"])


def sorted_entries(view: Any) -> Any:
    if isinstance(view, dict):
        return {k: sorted_entries(dict(sorted(v.items())) if k == "entries" else v)
                for k, v in view.items()}
    if isinstance(view, list):
        return [sorted_entries(item) for item in view]
    return view


@pytest.mark.parametrize("vector", VECTORS["records"] + VECTORS["messages"],
                         ids=lambda v: v["description"][:30])
def test_messages_parse_to_their_field_view(vector: dict[str, Any]) -> None:
    cls = getattr(pb, vector.get("message", "Record"))
    data = unbase64(vector["encoding_base64"])
    message = cls.FromString(data)
    view = MessageToDict(message, preserving_proto_field_name=True)
    assert sorted_entries(view) == vector["fields"]
    assert message.SerializeToString(deterministic=True) == data
