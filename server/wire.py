"""Register the Fleet servicer so that malformed protobuf earns INVALID_ARGUMENT.

The generated ``add_FleetServicer_to_server`` lets gRPC parse each request; when the
bytes do not parse, ``grpc.aio`` answers UNKNOWN ("Unexpected <class 'DecodeError'>")
and logs a traceback for every such message — an unclear status for the sender and a
cheap way to flood the server's log. Here the handlers receive the raw bytes and parse
them themselves: a message that does not parse is refused like any other invalid
message (INVALID_ARGUMENT, counted in the rejection metrics, one warning line). For a
streamed request the parse happens as each message arrives, and the servicer's own
error handling answers.

The methods come from the service descriptor, so an RPC added to ``fleet.proto`` is
registered without a change here.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.server.metrics import ServerMetrics

log = logging.getLogger("fedloom.server")

SERVICE = pb.DESCRIPTOR.services_by_name["Fleet"]


def parse(cls: type[Message], data: bytes) -> Message:
    """Parse ``data`` as ``cls``; `MessageRejectedError` (INVALID) if it does not parse."""
    try:
        return cls.FromString(data)
    except DecodeError as exc:
        raise MessageRejectedError(
            RejectReason.INVALID, f"malformed {cls.DESCRIPTOR.name}: not valid protobuf ({exc})"
        ) from exc


async def _refuse(context: grpc.aio.ServicerContext, rpc: str, exc: MessageRejectedError) -> None:
    log.warning("%s rejected from %s: %s", rpc, context.peer(), exc)
    ServerMetrics.rejected(exc.reason)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def _unary_request(
    rpc: str, cls: type[Message], method: Callable[..., Any]
) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def handle(data: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = parse(cls, data)
        except MessageRejectedError as exc:
            await _refuse(context, rpc, exc)
            raise  # abort() raised already; for the type checker
        outcome = method(request, context)
        if inspect.isasyncgen(outcome):  # a streaming answer written by yielding
            async for message in outcome:
                await context.write(message)
            return None
        return await outcome

    return handle


def _stream_request(
    cls: type[Message], method: Callable[..., Any]
) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext], Awaitable[Any]]:
    async def handle(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        async def parsed() -> AsyncIterator[Message]:
            async for data in requests:
                yield parse(cls, data)  # the servicer answers a MessageRejectedError

        return await method(parsed(), context)

    return handle


def add_fleet_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """Register every Fleet RPC of ``servicer`` on ``server`` (parsing in the handler)."""
    handlers = {}
    for method in SERVICE.methods:
        request_cls = getattr(pb, method.input_type.name)
        behaviour = getattr(servicer, method.name)
        serialize = codec.serialize_message  # protobuf objects, or frames made by the codec
        if method.client_streaming and not method.server_streaming:
            handlers[method.name] = grpc.stream_unary_rpc_method_handler(
                _stream_request(request_cls, behaviour), response_serializer=serialize
            )
        elif method.server_streaming and not method.client_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _unary_request(method.name, request_cls, behaviour), response_serializer=serialize
            )
        elif not method.client_streaming:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary_request(method.name, request_cls, behaviour), response_serializer=serialize
            )
        else:
            raise NotImplementedError(f"{method.name}: bidirectional streams are not wired")
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
