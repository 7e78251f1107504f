"""Negotiating the zstd stage: what a Join asks, what the server grants, how the wire
carries the grant and a compressed payload's header, and what is refused where. A peer
that knows nothing of the stage sends and receives exactly what it did before."""

from __future__ import annotations

import dataclasses

import pytest
from compression_support import join_fleet
from helpers import small_weights

from fedloom.cli import build_parser, server_config_from_args
from fedloom.client_sdk.connection import _check_codec_grants
from fedloom.config import ClientConfig, CompressionConfig, ServerConfig, from_mapping
from fedloom.errors import ConfigError, MessageRejectedError, RejectReason, TransportError
from fedloom.messages import (
    PROTOCOL_VERSION,
    JoinReply,
    ResultHeader,
    Session,
    TaskHeader,
)
from fedloom.payload import PayloadInfo, serialize
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.security_cli import client_config_from_args
from fedloom.server.fleet import Fleet
from fedloom.types import TaskKind

SESSION = Session("c1", b"s" * 32)
REPLY = JoinReply(SESSION, PROTOCOL_VERSION, frozenset({"fit"}), "run-1", 5.0, 20.0, 1024,
                  64 * 1024, 1 << 20)


def _join(tmp_path, asked_up=(), asked_down=(), **accepted) -> JoinReply:  # type: ignore[no-untyped-def]
    config = ServerConfig(insecure=True, state_dir=str(tmp_path),
                          compression=CompressionConfig(quantize_block=64, **accepted))
    return join_fleet(Fleet(config, "run-1"), tuple(asked_up), tuple(asked_down))


def test_the_stage_is_granted_with_its_codec_in_the_clients_order(tmp_path) -> None:  # type: ignore[no-untyped-def]
    accepted = {"upload": ("q8+zstd", "q8", "zstd"), "download": ("fp16+zstd", "zstd")}
    reply = _join(tmp_path, ("q4+zstd", "q8+zstd", "q8"), ("fp16+zstd",), **accepted)
    assert (reply.upload_codec, reply.upload_zstd) == (
        CompressionConfig(quantize_block=64).spec("q8"), True)
    assert reply.download_codec is not None and reply.download_codec.name == "fp16"
    assert reply.download_zstd
    reply = _join(tmp_path, ("zstd",), ("zstd",), **accepted)  # plain float32, compressed
    assert (reply.upload_codec, reply.upload_zstd) == (None, True)
    assert (reply.download_codec, reply.download_zstd) == (None, True)
    # A server that accepts q8 only grants it without the stage, to a client asking both.
    reply = _join(tmp_path, ("q8+zstd", "q8"), upload=("q8",))
    assert reply.upload_codec is not None and not reply.upload_zstd
    # Asking for the stage a server does not offer: nothing granted, nothing refused.
    reply = _join(tmp_path, ("zstd",), ("fp16+zstd",), upload=("q8",), download=("fp16",))
    assert reply == dataclasses.replace(reply, upload_codec=None, download_codec=None,
                                        upload_zstd=False, download_zstd=False)


def test_an_old_client_is_untouched(tmp_path) -> None:  # type: ignore[no-untyped-def]
    reply = _join(tmp_path, upload=("zstd", "q8+zstd"))
    assert reply.upload_codec is None and not reply.upload_zstd
    wire = pb.JoinResponse.FromString(codec.join_reply_to_proto(reply).SerializeToString())
    assert not wire.HasField("upload_encoding") and not wire.HasField("download_encoding")
    # A plain payload's header serializes as it did before the stage existed.
    info = PayloadInfo.describe(small_weights().specs(), serialize(small_weights()))
    header = codec.payload_to_proto(info)
    assert header.wire_bytes == 0
    assert header.SerializeToString() == pb.PayloadHeader(
        tensors=header.tensors, total_bytes=header.total_bytes,
        sha256=header.sha256).SerializeToString()


def test_grants_and_compressed_headers_survive_the_wire() -> None:
    for grant in ({"upload_zstd": True}, {"download_zstd": True},
                  {"upload_codec": CompressionConfig().spec("q8"), "upload_zstd": True}):
        reply = dataclasses.replace(REPLY, **grant)
        wire = codec.join_reply_to_proto(reply).SerializeToString()
        assert codec.join_reply_from_proto(pb.JoinResponse.FromString(wire)) == reply
    payload = serialize(small_weights())
    info = dataclasses.replace(PayloadInfo.describe(small_weights().specs(), payload),
                               wire_bytes=len(payload) - 1)
    task = TaskHeader("t", "run-1", 2, TaskKind.FIT, {}, 10.0, info)
    proto = codec.task_to_proto(task).task
    assert proto.encoding.zstd and not proto.encoding.codec
    assert codec.task_from_proto(proto) == task
    result = ResultHeader(SESSION, "t", 2, TaskKind.FIT, num_examples=3, base_round=1,
                          update=info)
    proto_result = codec.result_to_proto(result).result
    assert proto_result.encoding.zstd and proto_result.update.wire_bytes == len(payload) - 1
    assert codec.result_from_proto(proto_result) == result


def _refused(fn, *args, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MessageRejectedError, match=match) as info:
        fn(*args)
    assert info.value.reason is RejectReason.INVALID


def test_inconsistent_or_hostile_stage_fields_are_refused_when_parsed() -> None:
    base = codec.join_reply_to_proto(REPLY)
    for encoding, match in ((pb.Encoding(), "no codec and no zstd"),
                            (pb.Encoding(block=64, zstd=True), "settings but no codec")):
        reply = pb.JoinResponse()
        reply.CopyFrom(base)
        reply.upload_encoding.CopyFrom(encoding)
        _refused(codec.join_reply_from_proto, reply, match=match)
    payload = serialize(small_weights())
    info = PayloadInfo.describe(small_weights().specs(), payload)
    fit = ResultHeader(SESSION, "t", 2, TaskKind.FIT, num_examples=3, base_round=1, update=info)
    header = codec.result_to_proto(fit).result
    header.encoding.CopyFrom(pb.Encoding(zstd=True))  # the stage, but no wire_bytes
    _refused(codec.result_from_proto, header, match="wire_bytes is set exactly when")
    header = codec.result_to_proto(fit).result
    header.update.wire_bytes = 10  # wire_bytes, but no stage named
    _refused(codec.result_from_proto, header, match="wire_bytes is set exactly when")
    header.encoding.CopyFrom(pb.Encoding(zstd=True))
    header.update.wire_bytes = len(payload)  # not smaller than the payload
    _refused(codec.result_from_proto, header, match="must be smaller")
    evaluate = pb.ResultHeader(session=pb.Session(client_id="c1", secret=b"s"), task_id="t",
                               round=2, evaluate=pb.EvaluateResult(num_examples=1, loss=0.5),
                               encoding=pb.Encoding(zstd=True))
    _refused(codec.result_from_proto, evaluate, match="only a fit result")
    task = codec.task_to_proto(TaskHeader("t", "run-1", 2, TaskKind.FIT, {}, 10.0, info)).task
    task.weights.wire_bytes = 10
    _refused(codec.task_from_proto, task, match="wire_bytes is set exactly when")
    task.encoding.CopyFrom(pb.Encoding(zstd=True))
    task.secagg_unmask.CopyFrom(pb.SecAggUnmaskTask(
        round_id=pb.SecAggRoundId(run_id="run-1", round=2), survivors=["a", "b"]))
    _refused(codec.task_from_proto, task, match="carries the model unencoded")


def test_the_sdk_refuses_a_stage_it_did_not_ask_for() -> None:
    config = ClientConfig("h:1", insecure=True, upload_codecs=("q8+zstd",))
    q8 = CompressionConfig().spec("q8")
    _check_codec_grants(dataclasses.replace(REPLY, upload_codec=q8, upload_zstd=True), config)
    for grant in ({"upload_codec": q8}, {"upload_zstd": True}, {"download_zstd": True}):
        with pytest.raises(TransportError, match="did not ask for"):
            _check_codec_grants(dataclasses.replace(REPLY, **grant), config)


def test_config_names_and_flags() -> None:
    config = CompressionConfig(upload=("q8+zstd", "q8", "zstd"), download=("bf16+zstd",))
    assert [s.name for s in config.upload_specs] == ["q8"]
    for bad, match in ((("q8+gzip",), "unknown codec 'q8\\+gzip'"),
                       (("zstd+zstd",), "unknown codec")):
        with pytest.raises(ConfigError, match=match):
            CompressionConfig(upload=bad)
    with pytest.raises(ConfigError, match="for updates only"):
        CompressionConfig(download=("q8+zstd",))
    with pytest.raises(ConfigError, match="download_codecs"):
        ClientConfig("h:1", insecure=True, download_codecs=("q4+zstd",))
    args = build_parser().parse_args(["client", "--server", "h:1", "--app", "m:app",
                                      "--insecure", "--upload-codecs", "q8+zstd,q8",
                                      "--download-codecs", "zstd"])
    client = dataclasses.replace(client_config_from_args(args), upload_codecs=args.upload_codecs,
                                 download_codecs=args.download_codecs)
    assert client.upload_codecs == ("q8+zstd", "q8") and client.download_codecs == ("zstd",)
    server = server_config_from_args(build_parser().parse_args(
        ["server", "--insecure", "--compression-upload", "q8+zstd,zstd"]))
    assert server.compression.upload == ("q8+zstd", "zstd")


def test_the_stage_is_refused_under_secure_aggregation() -> None:
    for table in ({"upload": ("zstd",)}, {"download": ("fp16+zstd",)}):
        direction = next(iter(table))
        with pytest.raises(ConfigError, match=f"compression.{direction}.*uniformly random"):
            from_mapping(ServerConfig, {
                "insecure": True, "min_clients": 8, "min_fit_clients": 8,
                "compression": table,
                "secure_aggregation": {"enabled": True, "allow_unauthenticated": True}})
