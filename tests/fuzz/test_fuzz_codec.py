"""Hypothesis over the codec and the payload receiver: hostile messages are refused with
`MessageRejectedError`, never crash a decoder, and what is accepted is well formed.

Bounded for CI (``FEDLOOM_FUZZ_EXAMPLES``, default 40 per target, times the profile's
factor: ``tests/property_budget.py``); new inputs on every local run, the same ones in
CI (``HYPOTHESIS_PROFILE=ci`` derandomizes); ``benchmarks/fuzz.py`` runs the same targets
far longer.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from fuzz_codec_targets import (
    DECODERS,
    check_decoder,
    check_receiver,
    messages,
    mutate,
    parse_or_none,
    valid_or_random,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from property_budget import examples

from fedloom import Weights
from fedloom.payload import PayloadInfo, iter_chunks, serialize
from fedloom.protos import codec

EXAMPLES = examples(int(os.environ.get("FEDLOOM_FUZZ_EXAMPLES", "40")))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
IDS = [cls.__name__ for cls, _, _ in DECODERS]


@pytest.mark.parametrize(("cls", "decode", "encode"), DECODERS, ids=IDS)
def test_random_messages_are_decoded_or_rejected(cls, decode, encode) -> None:  # type: ignore[no-untyped-def]
    @FUZZ
    @given(valid_or_random(cls))
    def run(message):  # type: ignore[no-untyped-def]
        check_decoder(decode, encode, message)

    run()


_OPS = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 1 << 16), st.integers(0, 255)),
    min_size=1,
    max_size=6,
)


@pytest.mark.parametrize(("cls", "decode", "encode"), DECODERS, ids=IDS)
def test_mutated_bytes_are_decoded_or_rejected(cls, decode, encode) -> None:  # type: ignore[no-untyped-def]
    @FUZZ
    @given(valid_or_random(cls), _OPS)
    def run(message, ops):  # type: ignore[no-untyped-def]
        parsed = parse_or_none(cls, mutate(message.SerializeToString(), ops))
        if parsed is not None:
            check_decoder(decode, encode, parsed)

    run()


def test_shapes_whose_size_overflows_int64_are_rejected() -> None:
    """Shapes whose element count overflows int64 used to pass as 0 bytes."""
    from fedloom.errors import MessageRejectedError
    from fedloom.protos.fedloom.v1 import fleet_pb2 as pb

    for shape in ([1 << 40, 1 << 40], [1 << 32, 1 << 32, 1 << 32], [1 << 40] * 3):
        header = pb.PayloadHeader(
            tensors=[pb.TensorSpec(name="w", dtype="float32", shape=shape)],
            total_bytes=0,
            sha256=b"\x00" * 32,
        )
        with pytest.raises(MessageRejectedError):
            codec.payload_from_proto(header)


def test_names_with_control_characters_and_round_0_tasks_are_rejected() -> None:
    from fedloom.errors import MessageRejectedError
    from fedloom.protos.fedloom.v1 import fleet_pb2 as pb

    for name in ("site-1\nERROR forged log line", "a\x00b", "\x1b[31m"):
        with pytest.raises(MessageRejectedError, match="control characters"):
            codec.join_request_from_proto(pb.JoinRequest(protocol_version=1, name=name))
    codec.join_request_from_proto(pb.JoinRequest(protocol_version=1, name="hôpital 7"))
    task = pb.TaskHeader(task_id="t", run_id="r", round=0, fit=pb.FitTask())
    task.weights.sha256 = b"\x00" * 32
    with pytest.raises(MessageRejectedError, match="round"):
        codec.task_from_proto(task)


@st.composite
def _payload_and_chunks(draw):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tensors = {}
    for i in range(draw(st.integers(1, 3))):
        dtype = draw(st.sampled_from(["float32", "float16", "float64", "int64", "uint8"]))
        shape = tuple(draw(st.lists(st.integers(0, 7), max_size=3)))
        arr = rng.normal(size=shape).astype(dtype)
        if dtype.startswith("float") and arr.size and draw(st.booleans()):
            arr.reshape(-1)[draw(st.integers(0, arr.size - 1))] = draw(
                st.sampled_from([np.nan, np.inf, -np.inf])
            )
        tensors[f"t{i}"] = arr
    weights = Weights(tensors)
    payload = bytes(serialize(weights))
    header = codec.payload_to_proto(PayloadInfo.describe(weights.specs(), payload))
    pieces = list(iter_chunks(payload, draw(st.integers(1, 64)))) if payload else []
    edit = draw(st.sampled_from(["none", "shuffle", "drop", "repeat", "truncate", "flip",
                                 "offset", "empty", "header"]))  # fmt: skip
    if edit == "shuffle" and len(pieces) > 1:
        pieces = draw(st.permutations(pieces))
    elif edit == "drop" and pieces:
        del pieces[draw(st.integers(0, len(pieces) - 1))]
    elif edit == "repeat" and pieces:
        pieces.insert(
            draw(st.integers(0, len(pieces))), pieces[draw(st.integers(0, len(pieces) - 1))]
        )
    elif edit == "truncate" and pieces:
        pieces = pieces[: draw(st.integers(0, len(pieces) - 1))]
    elif edit == "flip" and pieces:
        i = draw(st.integers(0, len(pieces) - 1))
        data = bytearray(pieces[i][1])
        data[draw(st.integers(0, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))
        pieces[i] = (pieces[i][0], bytes(data))
    elif edit == "offset" and pieces:
        i = draw(st.integers(0, len(pieces) - 1))
        pieces[i] = (draw(st.integers(0, 1 << 64 - 1)), pieces[i][1])
    elif edit == "empty":
        pieces.insert(draw(st.integers(0, len(pieces))), (0, b""))
    elif edit == "header":
        header = draw(messages(header.DESCRIPTOR))
    return header, payload, pieces


@FUZZ
@given(_payload_and_chunks())
def test_chunk_streams_in_any_order_or_shape_are_accepted_only_when_exact(case) -> None:  # type: ignore[no-untyped-def]
    header, payload, pieces = case
    check_receiver(header, payload, pieces)
