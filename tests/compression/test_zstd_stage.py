"""The zstd stage on its own: names, lossless round trips through every codec, and the
receiver's bounds on hostile streams (a bomb, garbage, a short stream, a wrong digest, a
window too large), without the wire."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import zstandard

from fedloom import Weights
from fedloom.compression import (
    CODECS,
    CodecSpec,
    ZstdReceiver,
    compress,
    decode,
    encode,
    split_stage,
    stage_name,
    stage_names,
)
from fedloom.compression._zstd import MAX_WINDOW_BYTES, PIECE_BYTES
from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.payload import PayloadInfo, PayloadReceiver, deserialize, serialize

SPECS = {"fp16": CodecSpec("fp16"), "bf16": CodecSpec("bf16"), "q8": CodecSpec("q8", block=64),
         "q4": CodecSpec("q4", block=64), "topk": CodecSpec("topk", fraction=0.05)}


def _update(seed: int = 0) -> Weights:
    """A delta shaped like a trained one: most values small, a few large, some exactly 0
    (units that did not move), and an integer counter."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_t(3, size=(64, 48)) * 1e-3).astype(np.float32)
    w[:, ::5] = 0.0
    return Weights({"w": w, "b": (rng.normal(size=48) * 1e-2).astype(np.float32),
                    "steps": np.array(7, np.int64)})


class _Buffer:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data


class _Counting:
    """A `PayloadReceiver` that counts every byte the decompressor offers it."""

    def __init__(self, inner: PayloadReceiver) -> None:
        self.inner = inner
        self.offered = 0
        self.largest = 0

    @property
    def received(self) -> int:
        return self.inner.received

    def feed(self, offset: int, data: bytes) -> None:
        self.offered += len(data)
        self.largest = max(self.largest, len(data))
        self.inner.feed(offset, data)

    def finish(self) -> None:
        self.inner.finish()


def _receiver(info: PayloadInfo, wire_bytes: int, chunk: int = 1024
              ) -> tuple[ZstdReceiver, _Counting, _Buffer]:
    buffer = _Buffer()
    counting = _Counting(PayloadReceiver(info.specs, info.total_bytes, info.sha256, buffer,
                                         max_chunk_bytes=PIECE_BYTES))
    return ZstdReceiver(counting, wire_bytes, max_chunk_bytes=chunk), counting, buffer


def _send(receiver: ZstdReceiver, stream: bytes, chunk: int = 1024) -> None:
    for offset in range(0, len(stream), chunk):
        receiver.feed(offset, stream[offset:offset + chunk])
    receiver.finish()


def _invalid(fn, *args, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MessageRejectedError, match=match) as info:
        fn(*args)
    assert info.value.reason is RejectReason.INVALID


def test_names_split_and_join() -> None:
    assert split_stage("q8+zstd") == ("q8", True)
    assert split_stage("zstd") == ("", True)
    assert split_stage("fp16") == ("fp16", False)
    for name in stage_names(CODECS):
        assert stage_name(*split_stage(name)) == name
    assert "zstd" in stage_names(()) and "q8+zstd" not in stage_names(("fp16",))
    assert "zstd+zstd" not in stage_names(CODECS) and "+zstd" not in stage_names(CODECS)


@pytest.mark.parametrize("name", [None, *SPECS])
def test_every_codec_with_zstd_decodes_bit_identically(name: str | None) -> None:
    update = _update()
    spec = SPECS[name] if name else None
    encoded = encode(spec.build(), update, np.random.default_rng(1)) if spec else update
    payload = serialize(encoded)
    frame = compress(payload)
    assert frame is not None and len(frame) < len(payload)
    info = PayloadInfo.describe(encoded.specs(), payload)
    receiver, counting, buffer = _receiver(info, len(frame))
    _send(receiver, frame)
    assert bytes(buffer.data) == bytes(payload)  # lossless: the same bytes, the same digest
    assert counting.largest <= PIECE_BYTES
    received = deserialize(encoded.specs(), bytes(buffer.data))
    if spec is None:
        assert received.allclose(update, rtol=0, atol=0)
        return
    ours, theirs = decode(spec.build(), update.specs(), received), decode(
        spec.build(), update.specs(), encoded)
    for tensor in update:  # the decoded update, bit for bit
        assert ours[tensor].tobytes() == theirs[tensor].tobytes()


def test_a_frame_that_is_not_smaller_is_not_sent() -> None:
    noise = np.random.default_rng(0).bytes(4096)  # incompressible
    assert compress(noise) is None
    assert compress(b"") is None


def _info(total: int) -> PayloadInfo:
    payload = bytes(total)  # zeros
    return PayloadInfo.describe(Weights({"x": np.zeros(total, np.uint8)}).specs(), payload)


def test_a_bomb_is_refused_before_a_piece_past_its_declared_size_is_produced() -> None:
    total = 64 * 1024
    # 1000x the declared payload, compressed in a stream (never held whole here either).
    compressor = zstandard.ZstdCompressor(level=1).compressobj()
    zeros = bytes(1 << 20)
    bomb = b"".join(compressor.compress(zeros) for _ in range(1000 * total >> 20))
    bomb += compressor.flush()
    assert len(bomb) < total
    receiver, counting, buffer = _receiver(_info(total), len(bomb))
    _invalid(_send, receiver, bomb, match="exceeds the 65536 bytes")
    # What the decompressor produced at all: the payload, then at most one piece more.
    assert counting.offered <= total + PIECE_BYTES
    assert len(buffer.data) <= total


def test_garbage_a_short_stream_a_wrong_digest_and_a_large_window_are_refused() -> None:
    payload = bytes(range(256)) * 64
    info = PayloadInfo.describe(Weights({"x": np.zeros(len(payload), np.uint8)}).specs(),
                                payload)
    frame = compress(payload)
    assert frame is not None
    receiver, *_ = _receiver(info, 200)
    _invalid(_send, receiver, b"not zstd" * 25, match="not a valid zstd stream")
    receiver, *_ = _receiver(info, len(frame))  # ends early: the stream is cut short
    _invalid(_send, receiver, frame[:-4], match="ended after")
    receiver, *_ = _receiver(info, len(frame) - 4)  # declared short: the payload is short
    _invalid(_send, receiver, frame[:-4], match="stream ended after")
    other = compress(bytes(reversed(payload)))
    assert other is not None
    receiver, *_ = _receiver(info, len(other))
    _invalid(_send, receiver, other, match="digest mismatch")
    receiver, *_ = _receiver(info, len(frame) + 8)  # trailing bytes after the frame
    _invalid(_send, receiver, frame + b"trailing", match="not a valid zstd stream")
    receiver, *_ = _receiver(info, len(frame))  # out of order
    _invalid(receiver.feed, 5, frame[5:10], match="expected offset 0")
    # A frame whose window exceeds the bound: the decoder would need 4 MiB for it.
    big = np.random.default_rng(0).integers(0, 4, size=4 << 20, dtype=np.uint8).tobytes()
    wide = zstandard.ZstdCompressor(level=9).compress(big)
    assert zstandard.get_frame_parameters(wide).window_size > MAX_WINDOW_BYTES
    receiver, *_ = _receiver(PayloadInfo.describe(
        Weights({"x": np.zeros(len(big), np.uint8)}).specs(), big), len(wide), chunk=1 << 20)
    _invalid(_send, receiver, wide, 1 << 20, match="too much memory")


def test_a_client_without_zstandard_imports_and_refuses_the_stage_at_start() -> None:
    script = """
import sys
sys.modules["zstandard"] = None  # as on a device without the [zstd] extra
import fedloom.client_sdk, fedloom.client_sdk.runner, fedloom.client_sdk.connection
import fedloom.protos.codec, fedloom.config
from fedloom.config import ClientConfig, CompressionConfig
from fedloom.errors import ConfigError
ClientConfig("h:1", insecure=True, upload_codecs=("q8",))  # no stage: no package needed
for make in (lambda: ClientConfig("h:1", insecure=True, upload_codecs=("q8+zstd",)),
             lambda: CompressionConfig(download=("zstd",))):
    try:
        make()
    except ConfigError as exc:
        assert "fedloom[zstd]" in str(exc), exc
        print("refused:", exc)
    else:
        raise AssertionError("accepted the zstd stage without zstandard")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "upload_codecs" in done.stdout and "compression.download" in done.stdout
