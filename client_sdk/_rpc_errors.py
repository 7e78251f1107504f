"""gRPC errors translated into fedloom's error tree, at the client's edge.

An unknown session raises `SessionExpiredError` (join again), a server that is
unreachable or went away `TransportError` (retry later), and anything else the server
refused `ResultRefusedError` (do not retry it).
"""

from __future__ import annotations

import grpc

from fedloom._text import one_line
from fedloom.client_sdk.tls import handshake_hint
from fedloom.errors import ResultRefusedError, SessionExpiredError, TransportError

#: Status codes of a call that may succeed when tried again later.
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
}


#: The most of a server's status details a client keeps (they reach its log).
MAX_DETAILS = 500


def server_text(text: object) -> str:
    """A server's words, made safe for the client's log: one line (control characters
    escaped, so no forged log lines), at most `MAX_DETAILS` characters."""
    return one_line(text, MAX_DETAILS)


def translate(exc: grpc.RpcError, what: str) -> TransportError:
    """The fedloom error for a failed call; ``what`` names the call in the message."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = server_text(exc.details() if hasattr(exc, "details") else str(exc))
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return SessionExpiredError(f"{what}: {details}")
    if code in RETRYABLE:
        return TransportError(f"{what}: {code.name}: {details}{handshake_hint(details)}")
    return ResultRefusedError(code, f"{what}: {details}")
