"""Reading one task from the server's task stream: its header, then its weights, chunk by
chunk, verified against the header's digest before they are used (and then decoded, when
the task is encoded with this session's download codec). Weights sent zstd-compressed
are decompressed as their chunks arrive, with the same bounds as the server's
(`fedloom.compression.ZstdReceiver`: no more output than the header declares)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import numpy as np

from fedloom.client_sdk._compression import decode_model
from fedloom.client_sdk._watchdog import Watchdog
from fedloom.compression import CodecSpec, ZstdReceiver
from fedloom.compression._zstd import PIECE_BYTES
from fedloom.config import ClientConfig
from fedloom.errors import MessageRejectedError, ResultRefusedError, TransportError
from fedloom.messages import NoTask, TaskHeader
from fedloom.payload import PayloadReceiver, deserialize
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.weights import Weights

#: The slowest a task's weights may arrive on average: a download may take
#: ``rpc_timeout_s`` plus one second per this many bytes (a 40 MB model: 42 minutes), so
#: a server that drips its chunks cannot hold a client's call for ever.
MIN_DOWNLOAD_BYTES_PER_S = 16 * 1024


class BufferSink:
    """The download buffer of one task's weights, written in order as chunks arrive."""

    def __init__(self, size: int) -> None:
        self.buffer = np.empty(size, np.uint8)  # every byte is written: no zero-fill pass
        self._view = self.buffer.data
        self._pos = 0

    def write(self, data: bytes) -> None:
        self._view[self._pos : self._pos + len(data)] = data
        self._pos += len(data)


def receive_task(
    stream: Iterator[pb.PullResponse], watchdog: Watchdog, config: ClientConfig,
    run_id: str | None, whole_stream: bool, download_codec: CodecSpec | None = None,
    download_zstd: bool = False,
) -> tuple[TaskHeader, Weights] | NoTask:
    """Read one task: its header, then its chunks (to the end of a Pull's stream;
    on the Tasks stream, as many bytes as the header announces). A payload that came
    inside the header (the "inline" capability) is fed first, as its one chunk.

    ``run_id`` is the run this client joined (None: not checked); ``watchdog`` is
    touched on every message and, once the header is in, given the client's RPC timeout
    as the longest wait between chunks. ``download_codec`` is the codec this session was
    granted: an encoded task must name it (`decode_model`); a compressed one needs
    ``download_zstd``, the stage's grant.
    """
    first = next(stream, None)
    watchdog.touch()
    if first is None:
        raise TransportError("the server closed the task stream without an answer")
    part = first.WhichOneof("part")
    if part == "no_task":
        return codec.no_task_from_proto(first.no_task)
    if part != "task":
        raise TransportError(f"the server's task stream began with {part!r}")
    try:
        task = codec.task_from_proto(first.task)
    except MessageRejectedError as exc:
        raise TransportError(f"the server sent an invalid task: {exc}") from exc
    if run_id is not None and task.run_id != run_id:
        raise TransportError(
            f"the server sent a task of run {task.run_id[:40]!r}, not of the run "
            f"{run_id[:40]!r} this client joined; joining again"
        )
    info = task.weights
    limit = config.transfer.max_model_bytes
    # The bound is on the payload as it travels; a download codec's cast decodes it into
    # at most 4 times as many bytes (bf16 into float64).
    if info.total_bytes > limit:
        raise ResultRefusedError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the model is {info.total_bytes} bytes; this client accepts at most {limit} "
            "(transfer.max_model_bytes)",
        )
    if info.wire_bytes and not download_zstd:
        raise TransportError("the server sent the model zstd-compressed, but this session was "
                             "not granted the zstd stage")
    watchdog.idle_s = config.rpc_timeout_s  # between chunks, from now on
    try:
        sink = BufferSink(info.total_bytes)
    except MemoryError:
        raise _out_of_memory(info.total_bytes) from None
    receiver: PayloadReceiver | ZstdReceiver = PayloadReceiver(
        info.specs,
        info.total_bytes,
        info.sha256,
        sink,
        max_chunk_bytes=PIECE_BYTES if info.wire_bytes else config.transfer.max_message_bytes,
    )
    if info.wire_bytes:
        receiver = ZstdReceiver(receiver, info.wire_bytes,
                                max_chunk_bytes=config.transfer.max_message_bytes)
    allowed_s = config.rpc_timeout_s + info.wire_size / MIN_DOWNLOAD_BYTES_PER_S
    deadline = time.monotonic() + allowed_s
    try:
        if first.task.inline_payload:  # the whole payload came with the header
            receiver.feed(0, first.task.inline_payload)
        while whole_stream or receiver.received < info.wire_size:
            message = next(stream, None)
            if message is None:
                break  # finish() says whether the payload is whole
            watchdog.touch()
            if time.monotonic() > deadline:
                raise TransportError(
                    f"the task's weights did not arrive within {allowed_s:.1f} s "
                    f"({receiver.received} of {info.wire_size} bytes): slower than "
                    f"{MIN_DOWNLOAD_BYTES_PER_S // 1024} KiB/s after rpc_timeout_s")
            if message.WhichOneof("part") != "chunk":
                raise TransportError("the server sent a non-chunk inside a task's weights")
            receiver.feed(*codec.chunk_from_proto(message.chunk))
        receiver.finish()
    except MessageRejectedError as exc:
        raise TransportError(f"the task's weights failed verification: {exc}") from exc
    payload = deserialize(info.specs, sink.buffer.data.toreadonly())
    try:
        return task, decode_model(task, payload, download_codec)
    except MemoryError:
        raise _out_of_memory(sum(spec.nbytes for spec in task.model_specs)) from None


def _out_of_memory(nbytes: int) -> ResultRefusedError:
    """A model this device cannot hold: the task is refused, the client carries on."""
    return ResultRefusedError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"not enough memory for a model of {nbytes} bytes; lower transfer.max_model_bytes "
        "to what this device can hold")
