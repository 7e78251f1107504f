"""The fedloom exception tree.

Every error fedloom raises on purpose derives from :class:`FedloomError`, so an
application can catch one root. Messages say what went wrong and how to fix it.

::

    FedloomError
    ├── ConfigError              a setting is missing, of the wrong type or out of range
    ├── MessageRejectedError     a message from the network failed validation (has a reason)
    ├── AccessDeniedError        the server refused to admit this client (its credentials)
    ├── TransportError           talking to the peer failed (network, server gone)
    │   ├── SessionExpiredError  the server does not know this session: join again
    │   └── ResultRefusedError   the server refused a message: retrying will not help
    ├── CheckpointError          a checkpoint is missing, torn or fails its digest
    ├── AggregationError         a strategy cannot combine the updates it was given
    │   └── RoundAbortedError    a round ended without enough results to aggregate
    ├── SecureAggregationError   a secure-aggregation stage was refused or failed
    ├── ClientsUnavailableError  too few clients connected within the server's wait limit
    └── PrivacyBudgetExhausted   the next round would spend more than the privacy budget

Third-party errors are translated at the edge (``raise TransportError(...) from exc``).
A failure of one client is data (an error on its result), not an exception that
ends the round.
"""

from __future__ import annotations

import enum


class FedloomError(Exception):
    """Root of every error fedloom raises on purpose."""


class ConfigError(FedloomError, ValueError):
    """A configuration value is invalid; the message names the setting and the fix."""

    def __init__(self, setting: str, problem: str) -> None:
        self.setting = setting
        self.problem = problem
        super().__init__(f"{setting}: {problem}")


class RejectReason(enum.StrEnum):
    """Why a message from the network was refused.

    The server's gRPC layer maps each reason to one status code, so the kernel stays
    free of grpc.
    """

    INVALID = "invalid"  # malformed or out-of-range content -> INVALID_ARGUMENT
    STALE = "stale"  # valid once, but not for the current state -> FAILED_PRECONDITION
    TOO_LARGE = "too_large"  # beyond a configured limit -> RESOURCE_EXHAUSTED
    UNKNOWN_CLIENT = "unknown_client"  # no such session -> UNAUTHENTICATED
    FORBIDDEN = "forbidden"  # a known client asking for what is not its -> PERMISSION_DENIED
    CONFLICT = "conflict"  # a different payload for a used nonce -> ALREADY_EXISTS
    TIMEOUT = "timeout"  # a stream exceeded its time limit -> DEADLINE_EXCEEDED
    QUARANTINED = "quarantined"  # refused for a while after many bad messages -> RESOURCE_EXHAUSTED


class MessageRejectedError(FedloomError):
    """A message from the network failed validation and was dropped."""

    def __init__(self, reason: RejectReason, message: str) -> None:
        self.reason = reason
        super().__init__(message)


class TransportError(FedloomError):
    """Talking to the peer failed; retrying later may succeed."""


class SessionExpiredError(TransportError):
    """The server does not know this session (it restarted, or timed us out): re-join."""


class AccessDeniedError(FedloomError):
    """The server refused to admit this client: its credentials are missing, unknown or
    revoked (UNAUTHENTICATED), or it is not on the allow-list (PERMISSION_DENIED).
    Retrying will not help; the message says what to fix.

    ``code`` is the gRPC status (a ``grpc.StatusCode``, typed as its base `enum.Enum`
    so that the kernel does not import grpc).
    """

    def __init__(self, code: enum.Enum, details: str) -> None:
        self.code = code
        super().__init__(f"the server refused to admit this client: {code.name}: {details}")


class ResultRefusedError(TransportError):
    """The server refused a message for its content or timing; retrying will not help.

    ``code`` is the gRPC status (a ``grpc.StatusCode``, as for `AccessDeniedError`).
    """

    def __init__(self, code: enum.Enum, details: str) -> None:
        self.code = code
        super().__init__(f"{code.name}: {details}")


class CheckpointError(FedloomError):
    """A checkpoint could not be written or failed verification on load."""


class AggregationError(FedloomError):
    """A strategy could not combine the updates it was given."""


class RoundAbortedError(AggregationError):
    """A round ended (deadline, too many failures) without enough results."""


class SecureAggregationError(FedloomError):
    """A secure-aggregation stage was refused or could not complete."""


class ClientsUnavailableError(FedloomError):
    """Fewer than the clients a round needs connected within ``min_clients_wait_s``.

    The server stops with every committed round kept; started again, it resumes."""


class PrivacyBudgetExhausted(FedloomError):
    """The next round would take the run past its privacy budget (``target_epsilon``).

    Raised by a differentially private strategy before the round starts; the server
    and the simulation engines end the run cleanly at the last committed round.
    """

    def __init__(self, epsilon: float, next_epsilon: float, target: float, delta: float) -> None:
        self.epsilon = epsilon
        self.next_epsilon = next_epsilon
        self.target = target
        self.delta = delta
        super().__init__(
            f"privacy budget reached: epsilon is {epsilon:.4g} at delta {delta:g}, and the "
            f"next round would make it {next_epsilon:.4g}, above target_epsilon {target:g}"
        )
