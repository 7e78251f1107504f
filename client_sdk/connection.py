"""The client's side of the Fleet protocol over a gRPC channel.

`Connection` joins, reads its tasks from one Tasks stream (or long-polls Pull for each),
downloading and verifying their weights chunk by chunk, pushes results in chunks (a
result without a payload, or with a small one inside its header when the server granted
the "inline" capability, in one Report call), sends heartbeats and leaves. gRPC errors
are translated at this edge: a server that is unreachable or went away raises
`TransportError` (retry later), an unknown session raises `SessionExpiredError`
(join again), a refused message raises `ResultRefusedError` (do not retry it), and a
Join refused for its credentials raises `AccessDeniedError` (fix them). The channel is
TLS (`fedloom.client_sdk.tls`) unless the config asks for plaintext. A large result is
pushed over a short-lived connection of its own (`ClientConfig.separate_upload_connection`)
so the server does not keep upload-sized read buffers for every connected client.

The three client errors live in `fedloom.errors` and are importable from here too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from fedloom.client_sdk._download import receive_task
from fedloom.client_sdk._rpc_errors import server_text, translate
from fedloom.client_sdk._watchdog import Watchdog
from fedloom.client_sdk.tls import open_channel
from fedloom.compression import stage_name
from fedloom.config import ClientConfig
from fedloom.errors import (
    AccessDeniedError,
    MessageRejectedError,
    ResultRefusedError,
    SessionExpiredError,
    TransportError,
)
from fedloom.messages import (
    PROTOCOL_VERSION,
    Capability,
    JoinReply,
    JoinRequest,
    NoTask,
    ResultHeader,
    Session,
    TaskHeader,
)
from fedloom.payload import inline_limit, iter_chunk_views
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc
from fedloom.types import TaskKind
from fedloom.weights import Weights

__all__ = [
    "CAPABILITIES",
    "SEPARATE_UPLOAD_MIN_BYTES",
    "AccessDeniedError",
    "Connection",
    "ResultRefusedError",
    "SessionExpiredError",
]

log = logging.getLogger("fedloom.client")

#: This SDK runs every kind of task (secure-aggregation stages: client_sdk/secure_fit.py).
CAPABILITIES: frozenset[Capability] = frozenset(Capability)
#: Pushes of payloads this large go over a connection of their own when
#: ``ClientConfig.separate_upload_connection`` is on (smaller ones leave little behind).
SEPARATE_UPLOAD_MIN_BYTES = 64 * 1024
#: The longest a Leave may take (it is the last call of a session, often of a process).
LEAVE_TIMEOUT_S = 5.0
#: Tasks answered with an update about the size of their model (an evaluation is not).
_UPLOADING = frozenset({TaskKind.FIT, TaskKind.SECAGG})


class Connection:
    """One channel to the server, and the session on it once joined."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        t = config.transfer
        self._options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", t.max_message_bytes),
            ("grpc.max_send_message_length", t.max_message_bytes),
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # The runner backs off (with jitter) itself. gRPC's own reconnect backoff
            # lives in subchannels that every channel to the same address shares by
            # default: after an outage it grows toward 2 minutes and keeps even a
            # fresh channel away from a server that is back. Keep it per channel, short.
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.initial_reconnect_backoff_ms", int(config.reconnect_initial_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(config.reconnect_max_s * 1000)),
        ]
        self._channel = open_channel(config, self._options)
        self._stub = pb_grpc.FleetStub(self._channel)
        self._push = _push_method(self._channel)
        self.session: Session | None = None
        self.grant: JoinReply | None = None
        self._active: Any = None
        self._tasks: Any = None  # the open Tasks stream (ClientConfig.task_stream)
        self._lock = threading.Lock()
        self._watchdog = Watchdog()
        # The channel the next large push will use, opened (and connecting) when a task
        # with a large model arrives, so its handshake overlaps the training.
        self._upload: tuple[grpc.Channel, grpc.Future] | None = None
        self._uploading: grpc.Channel | None = None  # the separate channel of a push under way
        self._closed = False
        self._cut = False  # `cut_calls`: calls in flight cancelled, no new ones but Leave

    def close(self) -> None:
        self._closed = True
        self.cancel_active()
        self._close_tasks()
        self._watchdog.close()
        spare = self._take_upload_channel()
        if spare is not None:
            spare[0].close()
        self._channel.close()

    def cancel_active(self) -> None:
        with self._lock:
            if self._active is not None:
                self._active.cancel()

    def cut_calls(self) -> None:
        """Cancel every call in flight (a push, a join, a pull) and fail every later one
        at once, except `leave`, which then goes over a fresh channel: a stopping
        client's grace is over (`ClientConfig.stop_timeout_s`). Safe from any thread.

        Closing the channels is what cancels a blocking gRPC call from another thread.
        """
        with self._lock:
            self._cut = True
            uploading, self._uploading = self._uploading, None
        self.cancel_active()
        self._close_tasks()
        spare = self._take_upload_channel()
        for channel in (spare[0] if spare else None, uploading, self._channel):
            if channel is not None:
                channel.close()

    def _check_not_cut(self, what: str) -> None:
        if self._cut:
            raise TransportError(f"{what}: not sent, the client is stopping (its "
                                 "stop_timeout_s is over)")

    def _failed(self, exc: grpc.RpcError | ValueError, what: str) -> TransportError:
        """The error of a call that failed, naming the stop when `cut_calls` ended it (a
        closed channel fails a call in flight with CANCELLED and a new one with
        ValueError). A ValueError of any other origin is raised as it is."""
        if self._cut:
            return TransportError(f"{what}: cancelled, the client is stopping (its "
                                  "stop_timeout_s is over)")
        if isinstance(exc, ValueError):
            raise exc
        return translate(exc, what)

    def _session_proto(self) -> pb.Session:
        if self.session is None:
            raise SessionExpiredError("not joined")
        return codec.session_to_proto(self.session)

    # -- session --------------------------------------------------------------------
    def join(self, name: str, token: str = "") -> JoinReply:
        capabilities = (CAPABILITIES if self.config.transfer.inline_payloads
                        else CAPABILITIES - {Capability.INLINE})
        request = JoinRequest(PROTOCOL_VERSION, capabilities, name, token,
                              upload_codecs=self.config.upload_codecs,
                              download_codecs=self.config.download_codecs)
        self._check_not_cut("join")
        try:
            response = self._stub.Join(
                codec.join_request_to_proto(request), timeout=self.config.rpc_timeout_s
            )
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                raise AccessDeniedError(exc.code(), server_text(exc.details())) from exc
            raise self._failed(exc, "join") from exc
        except ValueError as exc:  # the channel was closed under the call (`cut_calls`)
            raise self._failed(exc, "join") from exc
        try:
            grant = codec.join_reply_from_proto(response)
        except MessageRejectedError as exc:
            raise TransportError(f"the server's join reply is invalid: {exc}") from exc
        if grant.protocol_version != PROTOCOL_VERSION:
            raise TransportError(
                f"the server speaks protocol {grant.protocol_version}, this client "
                f"{PROTOCOL_VERSION}: upgrade the client (or the server)"
            )
        _check_codec_grants(grant, self.config)
        if grant.chunk_size + 16 * 1024 > self.config.transfer.max_message_bytes:
            # Retried like an outage (with backoff, within max_reconnect_attempts): a
            # server's reply must not be able to end the client's process.
            raise TransportError(
                f"the server sends chunks of {grant.chunk_size} bytes, more than this "
                f"client's transfer.max_message_bytes "
                f"({self.config.transfer.max_message_bytes}) allows (less 16 KiB): raise "
                "it, or ask the server's operator")
        self.session, self.grant = grant.session, grant
        return grant

    def heartbeat(self) -> None:
        """Tell the server this session is alive; `TransportError` when it cannot be
        told, including when `close` (from another thread: the session's end) closed
        the channel just before the call."""
        request = pb.HeartbeatRequest(session=self._session_proto())
        try:
            self._stub.Heartbeat(request, timeout=self.config.rpc_timeout_s)
        except grpc.RpcError as exc:
            raise translate(exc, "heartbeat") from exc
        except ValueError as exc:  # gRPC's refusal of a call on a closed channel
            if not (self._closed or self._cut):
                raise
            raise TransportError("heartbeat: the connection is closed") from exc

    def leave(self, reason: str, session: Session | None = None) -> None:
        """End this connection's session, or ``session`` (an earlier one of this client,
        which its secret proves; the server ends no session because of a name)."""
        ending = session or self.session
        if ending is None:
            return
        request = pb.LeaveRequest(session=codec.session_to_proto(ending), reason=reason)
        sent = False
        try:
            if not self._cut:
                self._stub.Leave(request, timeout=LEAVE_TIMEOUT_S)
                sent = True
        except (grpc.RpcError, ValueError) as exc:  # ValueError: closed under the call
            log.debug("leave failed: %s", exc)
        if not sent and self._cut:  # its channel was closed, before or during the call:
            try:                    # a short-lived one of its own
                with open_channel(self.config, self._options) as channel:
                    pb_grpc.FleetStub(channel).Leave(request, timeout=LEAVE_TIMEOUT_S)
            except (grpc.RpcError, ValueError) as exc:
                log.debug("leave failed: %s", exc)
        if session is None:
            self.session = None

    # -- tasks ----------------------------------------------------------------------
    def pull(self) -> tuple[TaskHeader, Weights] | NoTask:
        """The next task, its weights downloaded and verified; or `NoTask`.

        From the session's Tasks stream (opened on first use and kept between tasks)
        when ``ClientConfig.task_stream`` is on, else from one long-poll Pull call.
        """
        self._check_not_cut("pull")
        streamed = self.config.task_stream
        call = self._tasks if streamed else None
        if call is None:
            request = pb.PullRequest(session=self._session_proto())
            call = self._stub.Tasks(request) if streamed else self._stub.Pull(request)
            if streamed:
                self._tasks = call
        first_wait = (self.grant.long_poll_s if self.grant else 20.0) + self.config.rpc_timeout_s
        watchdog = self._watchdog
        watchdog.arm(call, first_wait)
        with self._lock:
            self._active = call
        what = "task stream" if streamed else "pull"
        try:
            return self._receive_task(call, watchdog, whole_stream=not streamed)
        except BaseException as exc:
            if streamed:  # broken, or what is left of this task is unread: start afresh
                self._close_tasks()
            if not isinstance(exc, grpc.RpcError):
                raise
            if watchdog.fired:
                raise TransportError(f"the server stopped sending ({what} timed out)") from exc
            raise translate(exc, what) from exc
        finally:
            watchdog.disarm()
            with self._lock:
                self._active = None

    def _close_tasks(self) -> None:
        with self._lock:
            call, self._tasks = self._tasks, None
        if call is not None:
            call.cancel()

    def _receive_task(
        self, stream: Iterator[pb.PullResponse], watchdog: Watchdog, whole_stream: bool
    ) -> tuple[TaskHeader, Weights] | NoTask:
        """Read one task (`receive_task`); open the upload channel its result will need."""
        run_id = self.grant.run_id if self.grant is not None else None
        grant = self.grant
        outcome = receive_task(stream, watchdog, self.config, run_id, whole_stream,
                               grant.download_codec if grant is not None else None,
                               grant is not None and grant.download_zstd)
        if isinstance(outcome, NoTask):
            return outcome
        task, _weights = outcome
        if task.kind in _UPLOADING and self._separate(task.weights.total_bytes):
            self._prepare_upload_channel()  # an update of about this size will follow
        return outcome

    def push(self, result: ResultHeader, payload: memoryview | None) -> bool:
        """Send a result (and its payload); returns True if the server had it already."""
        chunk_size = self.grant.chunk_size if self.grant else self.config.transfer.chunk_size

        def messages() -> Iterator[pb.PushRequest | bytes]:
            yield codec.result_to_proto(result)
            if payload is not None:
                for offset, data in iter_chunk_views(payload, chunk_size):
                    yield codec.chunk_frame(offset, data)

        size = len(payload) if payload is not None else 0
        timeout = self.config.rpc_timeout_s + size / (1 << 20)  # >= 1 MiB/s
        self._check_not_cut("push")
        try:
            if payload is None and result.update is None:  # one message: no request stream
                response = self._stub.Report(codec.result_to_proto(result), timeout=timeout)
            elif payload is not None and self._inline(size, chunk_size):
                response = self._stub.Report(codec.result_to_proto(result, inline=payload),
                                             timeout=timeout)
            elif self._separate(size):
                # Its own connection: the server's gRPC frees the read buffers it grew
                # for these messages when the connection closes (see ClientConfig).
                prepared = self._take_upload_channel()
                channel = prepared[0] if prepared else open_channel(self.config, self._options)
                with self._lock:
                    self._uploading = channel
                try:
                    with channel:
                        self._check_not_cut("push")  # `cut_calls` may have missed it
                        response = _push_method(channel)(messages(), timeout=timeout)
                finally:
                    with self._lock:
                        self._uploading = None
            else:
                response = self._push(messages(), timeout=timeout)
        except (grpc.RpcError, ValueError) as exc:  # ValueError: closed under it (cut_calls)
            raise self._failed(exc, "push") from exc
        return bool(response.duplicate)

    def _inline(self, size: int, chunk_size: int) -> bool:
        """Whether a payload of ``size`` bytes goes inside its result header (Report)."""
        granted = self.grant is not None and Capability.INLINE in self.grant.capabilities
        return granted and 0 < size <= inline_limit(chunk_size)

    def _separate(self, size: int) -> bool:
        """Whether a push of ``size`` bytes goes over a connection of its own."""
        return size >= SEPARATE_UPLOAD_MIN_BYTES and self.config.separate_upload_connection

    def _prepare_upload_channel(self) -> None:
        """Open the next large push's channel and connect it now, without waiting.

        A Heartbeat on it (its answer is not needed) makes gRPC connect. Not
        `grpc.channel_ready_future`: its connectivity-polling thread held each later
        close of the channel for 0.1-0.15 s.
        """
        with self._lock:
            if self._upload is not None or self.session is None:
                return
            channel = open_channel(self.config, self._options)
            warm = pb_grpc.FleetStub(channel).Heartbeat.future(
                pb.HeartbeatRequest(session=self._session_proto()),
                timeout=self.config.rpc_timeout_s,
            )
            self._upload = (channel, warm)

    def _take_upload_channel(self) -> tuple[grpc.Channel, grpc.Future] | None:
        """The prepared upload channel (the caller closes it), or None."""
        with self._lock:
            prepared, self._upload = self._upload, None
        if prepared is not None:
            prepared[1].cancel()  # the warm-up Heartbeat, if still in flight
        return prepared


def _check_codec_grants(grant: JoinReply, config: ClientConfig) -> None:
    """A server may grant only a codec (and zstd stage) this client asked for, or none."""
    for granted, zstd, asked in (
            (grant.upload_codec, grant.upload_zstd, config.upload_codecs),
            (grant.download_codec, grant.download_zstd, config.download_codecs)):
        name = stage_name(granted.name if granted is not None else "", zstd)
        if name and name not in asked:
            shown = f"{granted}{'+zstd' if zstd else ''}" if granted is not None else name
            raise TransportError(f"the server granted codec {shown}, which this client did "
                                 f"not ask for (it asked for {list(asked)})")


def _push_method(channel: grpc.Channel) -> Any:
    """Fleet/Push on ``channel``, sending the codec's ready-made chunk frames (bytes)
    after the result's header."""
    return channel.stream_unary(
        "/fedloom.v1.Fleet/Push",
        request_serializer=codec.serialize_message,
        response_deserializer=pb.PushResponse.FromString,
    )
