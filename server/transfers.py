"""Moving one model through a stream, within the transfer limits.

`send_task` writes a task and its model to a client's Tasks stream (or Pull);
`receive_upload` feeds an upload the chunks of its Push stream. Both take a transfer
turn (`fedloom.server.transfer_slots`) only for a model of more than one chunk, and
hold it under a `TransferPace`: a stream that stops, or moves slower than
``min_transfer_rate`` (with ``transfer_window_s`` of slack), is cut with TIMEOUT, which
the servicer answers with DEADLINE_EXCEEDED and counts as a strike. So a few slow
clients cannot keep the turns from everyone else for a whole round (issue 20).

An upload that needs a turn arrives in full chunks of ``transfer.chunk_size`` (the size
every client learns at Join), only its last one shorter: a slot holder cannot pay for
its turn in bytes one at a time. A payload of one chunk needs no turn, so it is held
to no chunk size; the stream time limit bounds it.

A session granted the "inline" capability gets and sends payloads of at most
`fedloom.payload.inline_limit` bytes inside their headers: `send_task` writes one
message, and `receive_inline` feeds a Report's payload to its upload as its one chunk.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import grpc

from fedloom.config import ServerConfig
from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.messages import TaskHeader
from fedloom.payload import inline_limit, iter_chunk_views
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.server.metrics import ServerMetrics
from fedloom.server.transfer_slots import TransferPace, TransferSlots
from fedloom.server.uploads import Upload


@dataclasses.dataclass(frozen=True)
class TransferLimits:
    """The server's limits on one model stream (`ServerConfig`'s names in brackets)."""

    chunk_size: int  # transfer.chunk_size
    idle_s: float  # chunk_timeout_s
    min_rate: float  # min_transfer_rate, bytes per second (0: none)
    window_s: float  # transfer_window_s

    @classmethod
    def from_config(cls, config: ServerConfig) -> TransferLimits:
        return cls(config.transfer.chunk_size, config.chunk_timeout_s,
                   float(config.min_transfer_rate), config.transfer_window_s)

    def pace(self, size: int) -> TransferPace:
        """The pace of a stream of ``size`` bytes that holds a turn."""
        return TransferPace(self.idle_s, min_rate=self.min_rate, window_s=self.window_s,
                            size=size, chunk=self.chunk_size)

    def cut(self, what: str, pace: TransferPace) -> MessageRejectedError:
        """The refusal of a stream ``pace`` cut."""
        if pace.limit == "idle":
            return MessageRejectedError(
                RejectReason.TIMEOUT,
                f"{what} moved no chunk for {self.idle_s:g} s (chunk_timeout_s)")
        return MessageRejectedError(
            RejectReason.TIMEOUT,
            f"{what} is too slow: {pace.moved_bytes} of {pace.size} bytes in "
            f"{pace.elapsed_s():.1f} s, below the minimum of {self.min_rate:g} bytes/s "
            f"(min_transfer_rate, with transfer_window_s = {self.window_s:g} s of slack)")


class StreamBrokenError(Exception):
    """A write to the client failed: its end of the stream (its connection) is gone."""


async def write(context: grpc.aio.ServicerContext, message: object) -> None:
    """Write one message of a server stream; `StreamBrokenError` when the client is gone.

    A client that dies while a write waits on HTTP/2 flow control (mid-download) makes
    that write fail rather than cancel the call, with whichever of gRPC's internal
    errors the core reports; all of them mean the same here.
    """
    try:
        await context.write(message)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        raise StreamBrokenError(f"{type(exc).__name__}: {exc}") from exc


async def send_task(context: grpc.aio.ServicerContext, task: tuple[TaskHeader, memoryview],
                    wait_s: float, slots: TransferSlots, limits: TransferLimits,
                    inline: bool = False) -> bool:
    """Write a task's header and chunks, after waiting up to ``wait_s`` for a download
    turn; False (nothing written) if no turn came.

    ``inline``: the session was granted the "inline" capability. A payload of at most
    `inline_limit` bytes then travels inside the header, one message and no turn (it
    weighs no more than a header).

    Messages are written, not yielded, so that the caller's stream time limit covers
    every write: a client that stops reading (HTTP/2 flow control) cannot hold the
    stream.

    Raises:
        MessageRejectedError: TIMEOUT, the client read too slowly (`TransferPace`).
        StreamBrokenError: the client is gone.
    """
    header, payload = task
    if inline and 0 < len(payload) <= inline_limit(limits.chunk_size):
        await write(context, codec.task_to_proto(header, inline=payload))
        ServerMetrics.bytes_out(len(payload))
        return True
    async with slots.download(wait_s, len(payload)) as turn:
        if not turn:
            return False
        pace = limits.pace(len(payload))
        try:
            async with pace:
                await write(context, codec.task_to_proto(header))
                for offset, data in iter_chunk_views(payload, limits.chunk_size):
                    await write(context, codec.chunk_frame(offset, data))  # ready-made
                    pace.moved(len(data))
                    ServerMetrics.bytes_out(len(data))
        except TimeoutError:
            if pace.expired():
                raise limits.cut("download", pace) from None
            raise
    return True


async def receive_upload(upload: Upload, messages: AsyncIterator[pb.PushRequest],
                         slots: TransferSlots, limits: TransferLimits) -> None:
    """Feed ``upload`` the chunks that follow its header on ``messages``, to the end of
    the stream (`Upload.finish` then checks that the payload is whole).

    The first chunk is awaited without a turn (only the idle limit applies); the rest
    of a payload of more than one chunk moves under a turn and its `TransferPace`.

    Raises:
        MessageRejectedError: INVALID (not a chunk, a chunk out of order or of the
            wrong size, bad content), or TIMEOUT (idle, or too slow).
    """
    size = upload.size
    needs_turn = size > slots.free_bytes
    waiting = TransferPace(limits.idle_s)
    try:
        async with waiting:
            first = await anext(messages, None)
    except TimeoutError:
        if waiting.expired():
            raise limits.cut("upload", waiting) from None
        raise
    if first is None:
        return
    await _feed(upload, first, needs_turn, limits.chunk_size)
    pace = limits.pace(size - upload.received) if needs_turn else TransferPace(limits.idle_s)
    try:
        async with slots.upload(size if needs_turn else 0), pace:
            async for message in messages:
                await _feed(upload, message, needs_turn, limits.chunk_size)
                pace.moved(len(message.chunk.data))
    except TimeoutError:
        if pace.expired():
            raise limits.cut("upload", pace) from None
        raise


async def receive_inline(upload: Upload, data: bytes, limits: TransferLimits) -> None:
    """Feed ``upload`` the payload a Report carried inline (`Upload.finish` then checks
    it as a whole).

    Raises:
        MessageRejectedError: INVALID, larger than `inline_limit` (such a payload goes
            through Push), or bad content.
    """
    limit = inline_limit(limits.chunk_size)
    if len(data) > limit:
        raise MessageRejectedError(
            RejectReason.INVALID,
            f"an inline payload of {len(data)} bytes is over the limit of {limit} bytes; "
            "send it through Push")
    await upload.feed_async(0, data)
    ServerMetrics.bytes_in(len(data))


async def _feed(upload: Upload, message: pb.PushRequest, full_chunks: bool,
                chunk_size: int) -> None:
    if message.WhichOneof("part") != "chunk":
        raise MessageRejectedError(RejectReason.INVALID,
                                   "only chunks may follow the result header")
    offset, data = codec.chunk_from_proto(message.chunk)
    if full_chunks and len(data) != chunk_size and offset + len(data) != upload.size:
        raise MessageRejectedError(
            RejectReason.INVALID,
            f"chunk of {len(data)} bytes at offset {offset}: a payload of more than one "
            f"chunk is sent in chunks of chunk_size ({chunk_size} bytes, told at Join), "
            "only the last one shorter")
    await upload.feed_async(offset, data)
    ServerMetrics.bytes_in(len(data))
