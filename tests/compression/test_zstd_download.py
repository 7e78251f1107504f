"""The download path of the zstd stage on the client, and its byte accounting in a
simulation.

The client reads a task whose weights arrive as a zstd frame (`receive_task`, fed the
same messages the server writes) and decompresses them as they arrive, with the same
bounds as the server: a stream it was not granted, a bomb and a short stream are
refused. A simulation's ``[compression]`` accepts the stage and records the bytes the
payloads really take compressed, while what the strategy sees is unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
import zstandard

from fedloom import Weights
from fedloom.client_sdk._download import receive_task
from fedloom.client_sdk._watchdog import Watchdog
from fedloom.compression import CodecSpec, compress, decode, encode, make_codec
from fedloom.config import ClientConfig
from fedloom.errors import ConfigError, TransportError
from fedloom.messages import TaskHeader
from fedloom.payload import PayloadInfo, iter_chunk_views, serialize
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.simulations.compression import (
    DOWNLOAD_BYTES,
    UPLOAD_BYTES,
    CompressionSpec,
    SimulatedCompression,
)
from fedloom.simulations.scenario import scenario_from_mapping
from fedloom.types import ClientUpdate, TaskKind

FP16 = CodecSpec("fp16")
CONFIG = ClientConfig("h:1", insecure=True)


def _model() -> Weights:
    w = np.zeros((64, 32), np.float32)
    w[::4] = np.linspace(-1, 1, 32, dtype=np.float32)
    return Weights({"w": w, "b": np.zeros(32, np.float32)})


def _messages(task: TaskHeader, stream: bytes, chunk: int = 1024) -> Iterator[pb.PullResponse]:
    """What the server writes: the header, then the stream in ready-made chunk frames."""
    yield codec.task_to_proto(task)
    for offset, data in iter_chunk_views(stream, chunk):
        yield pb.PullResponse.FromString(codec.chunk_frame(offset, data))


def _task(payload_weights: Weights, stream: bytes | None = None, wire_bytes: int | None = None,
          encoded: bool = True) -> tuple[TaskHeader, bytes]:
    payload = serialize(payload_weights)
    frame = stream if stream is not None else compress(payload)
    assert frame is not None
    info = dataclasses.replace(PayloadInfo.describe(payload_weights.specs(), payload),
                               wire_bytes=wire_bytes or len(frame))
    task = TaskHeader("t", "run-1", 1, TaskKind.FIT, {"server_round": 1}, 10.0, info,
                      codec=FP16 if encoded else None,
                      decoded=_model().specs() if encoded else ())
    return task, frame


def _receive(task: TaskHeader, stream: bytes, zstd: bool = True, whole: bool = False
             ) -> Weights:
    outcome = receive_task(_messages(task, stream), Watchdog(), CONFIG, "run-1", whole,
                           task.codec, zstd)
    assert isinstance(outcome, tuple)
    return outcome[1]


def test_a_compressed_broadcast_is_decompressed_and_decoded() -> None:
    encoded = encode(FP16.build(), _model(), np.random.default_rng(0))
    task, frame = _task(encoded)
    assert len(frame) < encoded.nbytes / 4  # mostly zeros: several chunks all the same
    want = decode(FP16.build(), _model().specs(), encoded)
    for whole in (False, True):  # a Tasks stream (bytes counted) and a Pull (to its end)
        assert _receive(task, frame, whole=whole).allclose(want, rtol=0, atol=0)
    plain, plain_frame = _task(_model(), encoded=False)  # "zstd" alone: plain float32
    assert _receive(plain, plain_frame).allclose(_model(), rtol=0, atol=0)


def test_the_client_refuses_what_it_was_not_granted_a_bomb_and_a_short_stream() -> None:
    encoded = encode(FP16.build(), _model(), np.random.default_rng(0))
    task, frame = _task(encoded)
    with pytest.raises(TransportError, match="not granted the zstd stage"):
        _receive(task, frame, zstd=False)
    compressor = zstandard.ZstdCompressor(level=1).compressobj()
    bomb = b"".join(compressor.compress(bytes(1 << 20)) for _ in range(4)) + compressor.flush()
    bombed, _ = _task(encoded, bomb)  # 4 MiB of zeros for a payload of 4 KiB
    with pytest.raises(TransportError, match="exceeds the"):
        _receive(bombed, bomb)
    with pytest.raises(TransportError, match="ended after"):
        _receive(task, frame[:-10], whole=True)


RNG = np.random.default_rng(0)
DELTA = Weights({"w": np.where(RNG.random((40, 30)) < 0.3, RNG.normal(size=(40, 30)), 0)
                 .astype(np.float32), "steps": np.array([3], np.int64)})


def test_a_simulation_counts_the_compressed_bytes_and_changes_nothing_else() -> None:
    zstd = SimulatedCompression(CompressionSpec(upload="q8+zstd", download="fp16+zstd",
                                                quantize_block=64), base_seed=5)
    lossy = SimulatedCompression(CompressionSpec(upload="q8", download="fp16",
                                                 quantize_block=64), base_seed=5)
    update = ClientUpdate("2", DELTA, 10, 0)
    ours, theirs = zstd.update(update, 2, 1), lossy.update(update, 2, 1)
    for name in DELTA:  # the same seeded codes, decoded: the stage is lossless
        assert ours.delta[name].tobytes() == theirs.delta[name].tobytes()
    assert zstd.broadcast(_model()).allclose(lossy.broadcast(_model()), rtol=0, atol=0)
    codec_q8 = make_codec("q8", block=64)
    encoded = encode(codec_q8, DELTA, np.random.default_rng([5, 2, 1]))
    frame = compress(serialize(encoded))
    broadcast = compress(serialize(encode(FP16.build(), _model(), np.random.default_rng(0))))
    assert frame is not None and broadcast is not None
    traffic, plain = zstd.traffic(), lossy.traffic()
    assert traffic[UPLOAD_BYTES] == len(frame) < plain[UPLOAD_BYTES] == encoded.nbytes
    assert traffic[DOWNLOAD_BYTES] == len(broadcast) < plain[DOWNLOAD_BYTES]
    # Plain float32 that zstd cannot shrink travels uncompressed: its own size.
    noise = Weights({"w": np.random.default_rng(1).normal(size=(40, 30)).astype(np.float32)})
    alone = SimulatedCompression(CompressionSpec(upload="zstd"))
    alone.update(ClientUpdate("0", noise, 1, 0), 0, 1)
    assert alone.traffic()[UPLOAD_BYTES] <= noise.nbytes


def test_a_scenario_takes_the_stage_and_refuses_unknown_names() -> None:
    base = {"num_clients": 4, "clients_per_round": 2, "rounds": 1, "progress": False}
    scenario = scenario_from_mapping({**base, "compression": {"upload": "q4+zstd",
                                                              "download": "zstd"}})
    assert scenario.compression.upload == "q4+zstd"
    with pytest.raises(ConfigError, match=r"compression\.upload.*'q4\+lz4'"):
        scenario_from_mapping({**base, "compression": {"upload": "q4+lz4"}})
    with pytest.raises(ConfigError, match=r"compression\.download.*for updates"):
        scenario_from_mapping({**base, "compression": {"download": "q8+zstd"}})
