"""Negotiation: what a Join asks, what the server grants, and how the wire carries it.

A client that asks nothing gets nothing (every client older than compression); one
that asks only for codecs the server does not accept gets nothing either, and the server
says why; otherwise the first accepted codec in the client's order, with the server's
settings. Every compression field that arrives from the network is checked.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
from compression_support import join_fleet
from helpers import small_weights

from fedloom.client_sdk._compression import decode_model
from fedloom.client_sdk.connection import _check_codec_grants
from fedloom.compression import CodecSpec, encode, encoded_layout
from fedloom.config import ClientConfig, CompressionConfig, ServerConfig
from fedloom.errors import MessageRejectedError, RejectReason, TransportError
from fedloom.messages import (
    PROTOCOL_VERSION,
    JoinReply,
    JoinRequest,
    ResultHeader,
    Session,
    TaskHeader,
)
from fedloom.payload import PayloadInfo, serialize
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.server.fleet import Fleet
from fedloom.types import TaskKind

Q8 = CodecSpec("q8", block=64)
TOPK = CodecSpec("topk", fraction=0.25)
FP16 = CodecSpec("fp16")


def _fleet(tmp_path, **compression) -> Fleet:  # type: ignore[no-untyped-def]
    config = ServerConfig(insecure=True, state_dir=str(tmp_path),
                          compression=CompressionConfig(quantize_block=64, topk_fraction=0.25,
                                                        **compression))
    return Fleet(config, "run-1")




def test_a_client_that_asks_nothing_is_granted_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fleet = _fleet(tmp_path, upload=("q8", "topk"), download=("fp16",))
    reply = join_fleet(fleet)
    assert reply.upload_codec is None and reply.download_codec is None
    # As an old client sends it: no codec fields at all on the wire.
    old = codec.join_request_from_proto(pb.JoinRequest(protocol_version=PROTOCOL_VERSION,
                                                       capabilities=["fit"], name="old"))
    assert fleet.join(old).upload_codec is None
    assert not pb.JoinResponse.FromString(
        codec.join_reply_to_proto(reply).SerializeToString()).HasField("upload_encoding")


def test_the_first_accepted_codec_in_the_clients_order_is_granted(
        tmp_path, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    fleet = _fleet(tmp_path, upload=("q8", "topk"), download=("bf16", "fp16"))
    with caplog.at_level(logging.INFO, logger="fedloom.server"):
        reply = join_fleet(fleet, upload=("q2", "topk", "q8"), download=("fp16", "bf16"))
    assert reply.upload_codec == TOPK  # "q2" is unknown: skipped, not refused
    assert reply.download_codec == FP16
    granted = [r.getMessage() for r in caplog.records if "granted (it asked" in r.getMessage()]
    assert [line.split(": ", 1)[1] for line in granted] == [  # said, per direction
        "upload codec topk granted (it asked for ['q2', 'topk', 'q8'])",
        "download codec fp16 granted (it asked for ['fp16', 'bf16'])"]
    assert join_fleet(fleet, upload=("q8",)).upload_codec == Q8  # the server's block


def test_asking_for_codecs_the_server_does_not_accept_grants_none_and_says_why(
        tmp_path, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    fleet = _fleet(tmp_path, upload=("q8",))
    with caplog.at_level(logging.INFO, logger="fedloom.server"):
        reply = join_fleet(fleet, upload=("topk", "q4"), download=("fp16",))
    assert reply.upload_codec is None and reply.download_codec is None
    lines = [r.getMessage() for r in caplog.records if "none granted" in r.getMessage()]
    assert len(lines) == 2
    assert "['topk', 'q4']" in lines[0] and "accepts ['q8']" in lines[0]
    assert "accepts none" in lines[1] and "plain float32" in lines[1]


def test_grants_and_encodings_survive_the_wire() -> None:
    request = JoinRequest(PROTOCOL_VERSION, frozenset({"fit"}), "a", "", ("topk", "q8"),
                          ("fp16",))
    assert codec.join_request_from_proto(codec.join_request_to_proto(request)) == request
    reply = JoinReply(Session("c1", b"s" * 32), PROTOCOL_VERSION, frozenset({"fit"}), "run-1",
                      5.0, 20.0, 1024, 64 * 1024, 1 << 20, upload_codec=TOPK,
                      download_codec=FP16)
    wire = codec.join_reply_to_proto(reply).SerializeToString()
    assert codec.join_reply_from_proto(pb.JoinResponse.FromString(wire)) == reply
    weights = small_weights()
    encoded = encode(FP16.build(), weights, np.random.default_rng(0))
    task = TaskHeader("t", "run-1", 2, TaskKind.FIT, {}, 10.0,
                      PayloadInfo.describe(encoded.specs(), serialize(encoded)), codec=FP16,
                      decoded=weights.specs())
    assert codec.task_from_proto(codec.task_to_proto(task).task) == task
    assert task.model_specs == weights.specs()
    result = ResultHeader(Session("c1", b"s"), "t", 2, TaskKind.FIT, num_examples=3,
                          base_round=1, update=task.weights, codec=Q8)
    wire = codec.result_to_proto(result).SerializeToString()
    assert codec.result_from_proto(pb.PushRequest.FromString(wire).result) == result


def _refused(fn, *args, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MessageRejectedError, match=match) as info:
        fn(*args)
    assert info.value.reason is RejectReason.INVALID


def test_hostile_encodings_are_refused_when_parsed() -> None:
    base = codec.join_reply_to_proto(JoinReply(
        Session("c1", b"s" * 32), PROTOCOL_VERSION, frozenset({"fit"}), "run-1", 5.0, 20.0,
        1024, 64 * 1024, 1 << 20))
    for encoding, match in (
            (pb.Encoding(codec="gzip"), "names codec 'gzip'"),
            (pb.Encoding(codec="q8", block=0), "block"),
            (pb.Encoding(codec="q8", block=(1 << 20) + 1), "block"),
            (pb.Encoding(codec="topk", fraction=2.0), "fraction"),
            (pb.Encoding(codec="topk", fraction=float("nan")), "finite"),
            (pb.Encoding(codec="fp16", block=8), "takes no block"),
            (pb.Encoding(codec="q4", block=8, fraction=0.5), "takes no fraction")):
        reply = pb.JoinResponse()
        reply.CopyFrom(base)
        reply.upload_encoding.CopyFrom(encoding)
        _refused(codec.join_reply_from_proto, reply, match=match)
    _refused(codec.join_request_from_proto,
             pb.JoinRequest(protocol_version=5, upload_codecs=["q8"] * 9), match="at most 8")
    _refused(codec.join_request_from_proto,
             pb.JoinRequest(protocol_version=5, download_codecs=["fp\n16"]), match="control")


def test_an_encoding_only_travels_on_a_fit_result() -> None:
    header = pb.ResultHeader(session=pb.Session(client_id="c1", secret=b"s"), task_id="t",
                             round=2, evaluate=pb.EvaluateResult(num_examples=1, loss=0.5),
                             encoding=pb.Encoding(codec="q8", block=64))
    _refused(codec.result_from_proto, header, match="only a fit result")


def _task_proto(encoding: CodecSpec | None, payload_codec: CodecSpec | None,
                decoded: bool = True, kind: TaskKind = TaskKind.FIT) -> pb.TaskHeader:
    weights = small_weights()
    sent = encode(payload_codec.build(), weights, np.random.default_rng(0)) \
        if payload_codec is not None else weights
    task = TaskHeader("t", "run-1", 2, kind, {}, 10.0,
                      PayloadInfo.describe(sent.specs(), serialize(sent)), codec=encoding,
                      decoded=weights.specs() if decoded else ())
    return codec.task_to_proto(task).task


def test_a_client_refuses_an_encoded_task_whose_payload_is_not_its_encoded_model() -> None:
    _refused(codec.task_from_proto, _task_proto(FP16, None), match="not its model encoded")
    _refused(codec.task_from_proto, _task_proto(FP16, CodecSpec("bf16")),
             match="not its model encoded")
    _refused(codec.task_from_proto, _task_proto(FP16, FP16, decoded=False),
             match="name the layout")
    plain = _task_proto(None, None)
    plain.decoded_tensors.extend([pb.TensorSpec(name="w", dtype="float32", shape=[4, 3])])
    _refused(codec.task_from_proto, plain, match="no encoding is set")


def test_a_secure_stage_is_never_encoded() -> None:
    header = _task_proto(FP16, FP16)
    header.secagg_unmask.CopyFrom(pb.SecAggUnmaskTask(
        round_id=pb.SecAggRoundId(run_id="run-1", round=2), survivors=["a", "b"]))
    _refused(codec.task_from_proto, header, match="carries the model unencoded")


def test_the_sdk_refuses_what_it_did_not_ask_for() -> None:
    config = ClientConfig("h:1", insecure=True, upload_codecs=("q8",))
    reply = JoinReply(Session("c1", b"s" * 32), PROTOCOL_VERSION, frozenset({"fit"}), "run-1",
                      5.0, 20.0, 1024, 64 * 1024, 1 << 20)
    _check_codec_grants(reply, config)  # nothing granted: fine
    _check_codec_grants(JoinReply(**{**_fields(reply), "upload_codec": Q8}), config)
    for grant in ({"upload_codec": TOPK}, {"download_codec": FP16}):
        with pytest.raises(TransportError, match="did not ask for"):
            _check_codec_grants(JoinReply(**{**_fields(reply), **grant}), config)
    weights = small_weights()
    encoded = encode(FP16.build(), weights, np.random.default_rng(0))
    task = TaskHeader("t", "run-1", 2, TaskKind.FIT, {}, 10.0,
                      PayloadInfo.describe(encoded.specs(), serialize(encoded)), codec=FP16,
                      decoded=weights.specs())
    assert decode_model(task, encoded, FP16).allclose(weights, rtol=0, atol=0)
    with pytest.raises(TransportError, match="granted no download codec"):
        decode_model(task, encoded, None)
    with pytest.raises(TransportError, match="granted bf16"):
        decode_model(task, encoded, CodecSpec("bf16"))
    assert encoded_layout(FP16.build(), weights.specs()) == encoded.specs()


def _fields(reply: JoinReply) -> dict[str, object]:
    return {name: getattr(reply, name) for name in reply.__slots__}  # type: ignore[attr-defined]


def test_the_client_says_at_join_which_codecs_it_was_granted() -> None:
    from fedloom.client_sdk.runner import _granted_codecs

    base = JoinReply(Session("c1", b"s" * 32), PROTOCOL_VERSION, frozenset({"fit"}), "run-1",
                     5.0, 20.0, 1024, 64 * 1024, 1 << 20)
    assert _granted_codecs(base) == ""
    both = dataclasses.replace(base, upload_codec=TOPK, download_codec=FP16,
                               download_zstd=True)
    assert _granted_codecs(both) == f"; codecs granted: upload {TOPK}, download fp16+zstd"
    assert str(TOPK).startswith("topk(fraction=")  # with the settings the server set
    assert _granted_codecs(dataclasses.replace(base, upload_zstd=True)) == (
        "; codecs granted: upload zstd")
