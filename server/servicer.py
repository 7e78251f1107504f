"""The gRPC servicer: one method per RPC, translation only.

Each method decodes with `fedloom.protos.codec`, calls the coordinator and encodes the
answer. A `MessageRejectedError` becomes a gRPC status with a clear message (and a log
line), and the server carries on; the reason decides the status code.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable
from typing import NoReturn

import grpc

from fedloom._text import one_line
from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.messages import Capability, NoTask, TaskHeader
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc
from fedloom.server.auth import Authenticator
from fedloom.server.coordinator import Coordinator
from fedloom.server.metrics import ServerMetrics
from fedloom.server.registry import ClientRecord
from fedloom.server.transfer_slots import TransferSlots
from fedloom.server.transfers import (
    StreamBrokenError,
    TransferLimits,
    receive_inline,
    receive_upload,
    send_task,
    write,
)
from fedloom.server.uploads import Upload

log = logging.getLogger("fedloom.server")

# Who to blame for a refusal in the current RPC (each RPC runs in its own task, with its
# own context): set once the caller's session is authenticated.
_strike_caller: contextvars.ContextVar[Callable[[RejectReason], None] | None] = (
    contextvars.ContextVar("fedloom_strike_caller", default=None)
)

#: `FleetServicer._stream_next`'s answer when the Tasks stream is over.
_STREAM_ENDS = "\x00end"

STATUS = {
    RejectReason.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    RejectReason.STALE: grpc.StatusCode.FAILED_PRECONDITION,
    RejectReason.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RejectReason.UNKNOWN_CLIENT: grpc.StatusCode.UNAUTHENTICATED,
    RejectReason.FORBIDDEN: grpc.StatusCode.PERMISSION_DENIED,
    RejectReason.CONFLICT: grpc.StatusCode.ALREADY_EXISTS,
    RejectReason.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    RejectReason.QUARANTINED: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def peer_host(peer: str) -> str:
    """The address part of a gRPC peer string, without the port: the key under which a
    client known only by a label is quarantined ("ipv4:10.0.0.7:51344" -> "10.0.0.7",
    "ipv6:[::1]:5000" -> "::1"; other transports are kept whole)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    host = urllib.parse.unquote(rest).rpartition(":")[0]
    return host.strip("[]") or peer


async def _reject(
    context: grpc.aio.ServicerContext, rpc: str, exc: MessageRejectedError
) -> NoReturn:
    """Log, count and answer a refused message with its status; never returns.

    A refusal after the caller was authenticated (`FleetServicer._client`) is also a
    strike against that client (`fedloom.server.quarantine`)."""
    strike = _strike_caller.get()
    if strike is not None:
        strike(exc.reason)
    log.warning(
        "%s rejected from %s: %s (%s)", rpc, context.peer(), exc, exc.reason,
        extra={"rpc": rpc, "peer": context.peer(), "reason": str(exc.reason)},
    )
    ServerMetrics.rejected(exc.reason)
    await context.abort(STATUS[exc.reason], str(exc))
    raise exc  # abort() raises; this line only satisfies the type checker


class FleetServicer(pb_grpc.FleetServicer):
    def __init__(self, coordinator: Coordinator, auth: Authenticator | None = None) -> None:
        self.coordinator = coordinator
        self.auth = auth or Authenticator()  # default: no identities (anonymous)
        config = coordinator.config
        self.stream_timeout_s = config.stream_timeout_s
        self.limits = TransferLimits.from_config(config)
        # A few models stream at a time (memory stays flat); one chunk needs no turn.
        self.slots = TransferSlots(free_bytes=config.transfer.chunk_size)

    def _over_time(self, what: str) -> MessageRejectedError:
        return MessageRejectedError(
            RejectReason.TIMEOUT, f"{what} exceeded the {self.stream_timeout_s:.0f} s stream limit"
        )

    def _client(self, session: pb.Session):  # type: ignore[no-untyped-def]
        record = self.coordinator.registry.authenticate(codec.session_from_proto(session))
        _strike_caller.set(functools.partial(self.coordinator.strike, record))  # this RPC only
        return record

    async def Join(
        self, request: pb.JoinRequest, context: grpc.aio.ServicerContext
    ) -> pb.JoinResponse:
        try:
            join = codec.join_request_from_proto(request)
            identity = self.auth.identify(join.name, join.token, context.auth_context())
            reply = self.coordinator.join(join, identity, peer_host(context.peer()))
        except MessageRejectedError as exc:
            await _reject(context, "Join", exc)
        return codec.join_reply_to_proto(reply)

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        try:
            self.coordinator.heartbeat(self._client(request.session))
        except MessageRejectedError as exc:
            await _reject(context, "Heartbeat", exc)
        return pb.HeartbeatResponse(interval_s=self.coordinator.config.heartbeat_interval_s)

    async def Leave(
        self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext
    ) -> pb.LeaveResponse:
        try:
            if codec.session_from_proto(request.session).client_id not in self.coordinator.registry:
                # Already gone (a restart, the reaper, a client leaving the session it
                # replaced): nothing to end, and nothing worth a warning.
                return pb.LeaveResponse()
            self.coordinator.leave(self._client(request.session), one_line(request.reason, 200))
        except MessageRejectedError as exc:
            await _reject(context, "Leave", exc)
        return pb.LeaveResponse()

    async def Pull(  # type: ignore[override]
        self, request: pb.PullRequest, context: grpc.aio.ServicerContext
    ) -> None:
        record: ClientRecord | None = None
        try:
            polled = time.monotonic()
            record = self._client(request.session)
            outcome = await self.coordinator.pull(record)
            if not isinstance(outcome, tuple):
                await write(context, codec.no_task_to_proto(outcome))
                return
            # Wait for a turn only as long as the long-poll has left: the client's deadline.
            wait_s = max(0.0, self.coordinator.config.long_poll_s - (time.monotonic() - polled))
            if not await self._send_task(context, record, outcome, wait_s):
                # others are downloading: ask again (this task stays pending)
                await write(context, codec.no_task_to_proto(NoTask(retry_after_s=0.0)))
        except (asyncio.CancelledError, StreamBrokenError) as exc:
            self._went_away(record, exc)  # the client cut its long-poll, or its connection
        except TimeoutError:
            await _reject(context, "Pull", self._over_time("download"))
        except MessageRejectedError as exc:
            await _reject(context, "Pull", exc)

    async def Tasks(  # type: ignore[override]
        self, request: pb.PullRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """The session's tasks on one stream: each pending task once, in turn (see the
        proto). Saves a call per task, which a secure round's stages feel most."""
        record: ClientRecord | None = None
        try:
            record = self._client(request.session)
            sent: str | None = None  # the client is answering this one: not offered again
            while sent != _STREAM_ENDS:
                sent = await self._stream_next(context, record, sent)
        except (asyncio.CancelledError, StreamBrokenError) as exc:
            self._went_away(record, exc)  # the client cut its stream, or its connection
        except TimeoutError:
            await _reject(context, "Tasks", self._over_time("download"))
        except MessageRejectedError as exc:
            await _reject(context, "Tasks", exc)

    def _went_away(self, record: ClientRecord | None,
                   exc: asyncio.CancelledError | StreamBrokenError) -> None:
        """The client's task stream (or long-poll) broke: its session ends now, not
        ``client_timeout_s`` later. A cancel goes on up; a failed write ends the call
        quietly (nothing can reach the client any more)."""
        if record is not None:
            self.coordinator.stream_closed(record)
        if isinstance(exc, asyncio.CancelledError):
            raise exc
        log.info("task stream of client %s broke mid-write (%s)",
                 record.client_id if record is not None else "?", exc)

    async def _stream_next(
        self, context: grpc.aio.ServicerContext, record: ClientRecord, sent: str | None
    ) -> str | None:
        """Wait for the next task and write it (or a NoTask); returns the id of the task
        the client now answers, or `_STREAM_ENDS`. A function of its own so that the
        task's payload (a round's whole model) is not kept alive by the stream while it
        waits for the next task: a long-lived stream would otherwise hold the previous
        round's model for every client."""
        outcome = await self.coordinator.pull(record, sent)
        if not isinstance(outcome, tuple):
            await write(context, codec.no_task_to_proto(outcome))
            if outcome.run_finished or self.coordinator.stopping:
                return _STREAM_ENDS
            return sent  # a keep-alive every long_poll_s
        if await self._send_task(context, record, outcome,
                                  self.coordinator.config.long_poll_s):
            return outcome[0].task_id
        # no download turn within a long-poll: say so, then wait for one again
        await write(context, codec.no_task_to_proto(NoTask(retry_after_s=0.0)))
        return sent

    async def _send_task(self, context: grpc.aio.ServicerContext, record: ClientRecord,
                         task: tuple[TaskHeader, memoryview], wait_s: float) -> bool:
        """`fedloom.server.transfers.send_task`, within the stream time limit."""
        inline = Capability.INLINE in record.info.capabilities
        async with asyncio.timeout(self.stream_timeout_s):
            return await send_task(context, task, wait_s, self.slots, self.limits, inline)

    async def Push(
        self, request_iterator: AsyncIterator[pb.PushRequest], context: grpc.aio.ServicerContext
    ) -> pb.PushResponse:
        upload: Upload | None = None
        try:
            async with asyncio.timeout(self.stream_timeout_s):
                messages = aiter(request_iterator)
                first = await anext(messages, None)
                if first is None or first.WhichOneof("part") != "result":
                    raise MessageRejectedError(
                        RejectReason.INVALID, "a Push stream must start with a result header"
                    )
                client = self._client(first.result.session)  # first: refusals are its strikes
                if first.result.inline_payload:
                    raise MessageRejectedError(
                        RejectReason.INVALID,
                        "a payload inside its result header goes through Report, not Push")
                header = codec.result_from_proto(first.result)
                outcome = await self.coordinator.accept_result(client, header)
                if not isinstance(outcome, Upload):
                    return pb.PushResponse(duplicate=outcome)
                upload = outcome
                await receive_upload(upload, messages, self.slots, self.limits)
            finishing, upload = upload, None
            await finishing.finish()  # verified, then folded by the task's owner
            return pb.PushResponse(duplicate=False)
        except TimeoutError:
            await _reject(context, "Push", self._over_time("upload"))
        except MessageRejectedError as exc:
            await _reject(context, "Push", exc)
        finally:
            if upload is not None:
                upload.abandon()

    async def Report(
        self, request: pb.PushRequest, context: grpc.aio.ServicerContext
    ) -> pb.PushResponse:
        """A result in one message (one call, no request stream): without a payload, or,
        from a session granted "inline", with a small one inside its header."""
        upload: Upload | None = None
        try:
            if request.WhichOneof("part") != "result":
                raise MessageRejectedError(RejectReason.INVALID, "a Report carries a result header")
            client = self._client(request.result.session)  # first: refusals are its strikes
            inline = request.result.inline_payload
            if inline and Capability.INLINE not in client.info.capabilities:
                raise MessageRejectedError(
                    RejectReason.INVALID, "this session was not granted the 'inline' capability: "
                    "send the payload through Push")
            header = codec.result_from_proto(request.result)
            if header.update is None and inline:
                raise MessageRejectedError(
                    RejectReason.INVALID, "an inline payload needs the update header that "
                    "describes it")
            if header.update is not None and not inline:
                raise MessageRejectedError(
                    RejectReason.INVALID, "a result with a payload goes through Push, not Report"
                )
            outcome = await self.coordinator.accept_result(client, header)
            if not isinstance(outcome, Upload):
                return pb.PushResponse(duplicate=outcome)
            upload = outcome
            await receive_inline(upload, inline, self.limits)  # all here: no stream to time
            finishing, upload = upload, None
            await finishing.finish()  # verified, then folded by the task's owner (as Push)
            return pb.PushResponse(duplicate=False)
        except MessageRejectedError as exc:
            await _reject(context, "Report", exc)
        finally:
            if upload is not None:
                upload.abandon()
