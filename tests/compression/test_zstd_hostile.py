"""Hostile zstd streams over real gRPC: each is refused with its status, its task fails,
and the round completes with the honest clients; the server's decompression never runs
past what the header declares.

The hostile clients are raw `Connection`s driven from the test: they join asking for
their stages, take their fit task and push a forged compressed update.
"""

from __future__ import annotations

import dataclasses
import logging

import grpc
import numpy as np
import pytest
import zstandard
from compression_support import (
    client_threads,
    joined,
    next_fit_task,
    rounds_committed,
)
from helpers import ScriptedClient

from fedloom import Weights
from fedloom.compression import CodecSpec, compress, decode, encode
from fedloom.compression import _zstd as zstd_stage
from fedloom.config import CompressionConfig, TransferConfig
from fedloom.errors import ResultRefusedError
from fedloom.messages import ResultHeader
from fedloom.payload import PayloadInfo, serialize
from fedloom.server import Server
from fedloom.types import TaskKind

Q8 = CodecSpec("q8", block=64)
TRANSFER = TransferConfig(chunk_size=4096, max_message_bytes=64 * 1024)
EXAMPLES = 5


def _model() -> Weights:
    return Weights({"w": np.zeros((64, 64), np.float32)})


def _delta(seed: int = 11) -> Weights:
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(64, 64)).astype(np.float32)
    w[rng.random((64, 64)) > 0.2] = 0  # compressible, as a trained update is
    return Weights({"w": w})


def _q8(seed: int = 11) -> Weights:
    return encode(Q8.build(), _delta(seed), np.random.default_rng(0))


def _bomb(total: int) -> bytes:
    """A zstd stream of zeros 1000 times ``total`` bytes long, itself far below it."""
    compressor = zstandard.ZstdCompressor(level=1).compressobj()
    zeros = bytes(1 << 20)
    frames = [compressor.compress(zeros) for _ in range(max(1, 1000 * total >> 20))]
    return b"".join(frames) + compressor.flush()


def _case(weights: Weights, stream: bytes | None = None, declared: int | None = None,
          sent: bytes | None = None) -> tuple[PayloadInfo, bytes]:
    """What is pushed: the header of ``weights``' payload, as compressed to ``stream``
    (default: its honest zstd frame) of ``declared`` bytes, and the bytes sent."""
    payload = serialize(weights)
    frame = stream if stream is not None else compress(payload)
    assert frame is not None
    info = dataclasses.replace(PayloadInfo.describe(weights.specs(), payload),
                               wire_bytes=declared or len(frame))
    return info, sent if sent is not None else frame


# name -> (stages asked at Join, the codec the header claims, what is pushed, the status)
def _cases() -> dict[str, tuple[tuple[str, ...], CodecSpec | None, tuple[PayloadInfo, bytes],
                                grpc.StatusCode | None]]:
    q8 = _q8()
    good = compress(serialize(q8))
    assert good is not None
    size = len(serialize(q8))
    return {
        "not-granted": (("q8",), Q8, _case(q8), grpc.StatusCode.FAILED_PRECONDITION),
        "garbage": (("q8+zstd",), Q8, _case(q8, b"\x28\xb5\x2f\xfd" + b"\xff" * 900),
                    grpc.StatusCode.INVALID_ARGUMENT),
        "ends-early": (("q8+zstd",), Q8, _case(q8, good, sent=good[: len(good) // 2]),
                       grpc.StatusCode.INVALID_ARGUMENT),
        "bomb": (("q8+zstd",), Q8, _case(q8, _bomb(size)), grpc.StatusCode.INVALID_ARGUMENT),
        "wrong-digest": (("q8+zstd",), Q8, _case(q8, compress(serialize(_q8(12)))),
                         grpc.StatusCode.INVALID_ARGUMENT),
        # Granted q8+zstd, sends q8 uncompressed; granted zstd, sends plain compressed.
        "uncompressed": (("q8+zstd",), Q8, (PayloadInfo.describe(q8.specs(), serialize(q8)),
                                            bytes(serialize(q8))), None),
        "zstd-alone": (("zstd",), None, _case(_delta()), None),
    }


def test_each_hostile_stream_is_refused_and_the_round_completes_without_it(
        server_config, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    cases = _cases()
    offered = []  # bytes the server's decompressor produced, per payload piece
    real_write = zstd_stage._Pieces.write

    def counting(pieces: object, data: bytes) -> int:
        offered.append(len(data))
        return real_write(pieces, data)  # type: ignore[arg-type]

    monkeypatch.setattr(zstd_stage._Pieces, "write", counting)
    config = server_config(num_rounds=1, min_clients=2 + len(cases), min_fit_clients=2,
                           fraction_evaluate=0.0, client_timeout_s=20.0, transfer=TRANSFER,
                           compression=CompressionConfig(upload=("q8+zstd", "q8", "zstd"),
                                                         quantize_block=64))
    handle = Server(config, initial_weights=_model()).start()
    connections = joined(handle.address, cases, transfer=TRANSFER)
    honest = {f"h{i}": ScriptedClient(seed=i, num_examples=10 + i) for i in range(2)}
    statuses: dict[str, grpc.StatusCode | None] = {}
    try:
        with caplog.at_level(logging.WARNING, logger="fedloom.server"), client_threads(
                handle.address, {n: (c, {"transfer": TRANSFER}) for n, c in honest.items()}):
            for name, (_, claimed, (info, sent), _status) in cases.items():
                connection = connections[name]
                task = next_fit_task(connection)
                result = ResultHeader(connection.session, task.task_id, task.round, TaskKind.FIT,
                                      num_examples=EXAMPLES, base_round=task.round - 1,
                                      update=info, codec=claimed)
                offered.clear()
                try:
                    connection.push(result, memoryview(sent))
                    statuses[name] = None
                except ResultRefusedError as exc:
                    statuses[name] = exc.code  # type: ignore[assignment]
                if name == "bomb":  # refused one piece past the payload, at most
                    assert sum(offered) <= info.total_bytes + zstd_stage.PIECE_BYTES
            history = handle.wait(60)
    finally:
        for connection in connections.values():
            connection.close()
    assert statuses == {name: case[3] for name, case in cases.items()}
    record = history[-1]
    assert record.status == "ok"
    refused = sum(1 for case in cases.values() if case[3] is not None)
    assert (record.num_updates, record.num_failures) == (4, refused)
    # Each refused stream failed its task at once (the owner's line for the task; not
    # the client's timeout, nor the round's deadline).
    failed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("client ")
              and ("zstd stream:" in r.getMessage() or "zstd-compressed" in r.getMessage())]
    assert len(failed) == refused, failed
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "was not granted the zstd stage" in text
    assert "not a valid zstd stream" in text and "zstd stream ended after" in text
    assert "exceeds the" in text and "digest mismatch" in text
    # The new model is the mean of the honest updates and the two accepted forged ones
    # (the q8 one decoded, the compressed plain one as it was before compression).
    updates = [(c.num_examples, c.sent[0][2]["w"] - c.sent[0][1]["w"]) for c in honest.values()]
    updates += [(EXAMPLES, decode(Q8.build(), _model().specs(), _q8())["w"]),
                (EXAMPLES, _delta()["w"])]
    want = sum(n * np.asarray(d, np.float64) for n, d in updates) / sum(n for n, _ in updates)
    got = rounds_committed(config.state_dir)[1]
    np.testing.assert_allclose(got["w"], want, rtol=1e-6, atol=1e-6)
