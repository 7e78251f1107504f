"""Register services so that malformed protobuf earns INVALID_ARGUMENT, not UNKNOWN.

The generated ``add_*Servicer_to_server`` functions let gRPC parse each request; when
the bytes do not parse, ``grpc.aio`` answers UNKNOWN ("Unexpected <class
'DecodeError'>") and logs an ERROR traceback for every such message — an unclear
status for the sender and a cheap way to flood the server's log. Here the handlers
receive the raw bytes and parse them themselves: a message that does not parse is
refused like any other invalid message (INVALID_ARGUMENT, counted in the rejection
metrics), and the log gets one warning line per `RefusalLog` interval, however many
arrive. For a streamed request the parse happens as each message arrives; the Fleet
servicer answers its own refusals, and any refusal that reaches the handler is answered
here.

Every service of the port goes through this: Fleet (`add_fleet_servicer`), and the
standard health and reflection services (`add_parsed_service`,
`fedloom.server.observability`). The methods come from the service descriptor, so an
RPC added to ``fleet.proto`` is registered without a change here.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.server.metrics import ServerMetrics

log = logging.getLogger("fedloom.server")

SERVICE = pb.DESCRIPTOR.services_by_name["Fleet"]


class RefusalLog:
    """Warnings for refused malformed requests, at most one line per ``interval_s``.

    A flood of garbage costs the log one line per interval; the line says how many
    refusals it stands for (the metrics count every one).
    """

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._next = float("-inf")
        self._held = 0  # refusals since the last line

    def refused(self, rpc: str, peer: str, message: str) -> None:
        self._held += 1
        now = self._clock()
        if now < self._next:
            return
        more = f" (and {self._held - 1} more in the last {self.interval_s:g} s)" \
            if self._held > 1 else ""
        log.warning("%s rejected from %s: %s%s", rpc, peer, message, more,
                    extra={"rpc": rpc, "peer": peer, "reason": str(RejectReason.INVALID)})
        self._held = 0
        self._next = now + self.interval_s


#: One for the whole process: a flood is one flood whichever service it targets.
refusals = RefusalLog()


def parse(cls: type[Message], data: bytes) -> Message:
    """Parse ``data`` as ``cls``; `MessageRejectedError` (INVALID) if it does not parse."""
    try:
        return cls.FromString(data)
    except DecodeError as exc:
        raise MessageRejectedError(
            RejectReason.INVALID, f"malformed {cls.DESCRIPTOR.name}: not valid protobuf ({exc})"
        ) from exc


async def _refuse(context: grpc.aio.ServicerContext, rpc: str, exc: MessageRejectedError) -> None:
    refusals.refused(rpc, context.peer(), str(exc))
    ServerMetrics.rejected(exc.reason)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


async def _answer(outcome: Any, context: grpc.aio.ServicerContext) -> Any:
    """Run a servicer method's outcome: a coroutine, or an async generator of replies."""
    if inspect.isasyncgen(outcome):  # a streaming answer written by yielding
        async for message in outcome:
            await context.write(message)
        return None
    return await outcome


def _unary_request(
    rpc: str, cls: type[Message], method: Callable[..., Any]
) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def handle(data: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = parse(cls, data)
        except MessageRejectedError as exc:
            await _refuse(context, rpc, exc)
            raise  # abort() raised already; for the type checker
        return await _answer(method(request, context), context)

    return handle


def _stream_request(
    rpc: str, cls: type[Message], method: Callable[..., Any]
) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext], Awaitable[Any]]:
    async def handle(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        async def parsed() -> AsyncIterator[Message]:
            async for data in requests:
                yield parse(cls, data)

        try:
            return await _answer(method(parsed(), context), context)
        except MessageRejectedError as exc:  # one the servicer did not answer itself
            await _refuse(context, rpc, exc)
            raise

    return handle


def add_parsed_service(service: ServiceDescriptor, servicer: Any, server: grpc.aio.Server,
                       serialize: Callable[[Any], bytes] = codec.serialize_message) -> None:
    """Register the methods of ``service`` that ``servicer`` implements on ``server``,
    each parsing its own requests (see the module docstring)."""
    handlers = {}
    for method in service.methods:
        behaviour = getattr(servicer, method.name, None)
        if behaviour is None:
            continue  # a newer proto than the servicer: gRPC answers UNIMPLEMENTED
        request_cls = GetMessageClass(method.input_type)
        rpc = method.name
        if method.client_streaming:
            handle: Any = _stream_request(rpc, request_cls, behaviour)
            make = (grpc.stream_stream_rpc_method_handler if method.server_streaming
                    else grpc.stream_unary_rpc_method_handler)
        else:
            handle = _unary_request(rpc, request_cls, behaviour)
            make = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                    else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = make(handle, response_serializer=serialize)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )


def add_fleet_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """Register every Fleet RPC of ``servicer`` on ``server`` (parsing in the handler)."""
    add_parsed_service(SERVICE, servicer, server)
