"""Secure fit rounds on the server: the transport of SecAgg+ over the Fleet protocol.

The protocol itself (the pure state machines, the primitives, the messages) lives in
`fedloom.secagg`; this package runs it through the server's task mailboxes:
`SecureRounds` drives a round's attempts, `SecureAttempt` turns one attempt's stages
into tasks and folds the masked inputs as they arrive.
"""

from fedloom.server.secure.attempt import SecureAttempt, StageTask
from fedloom.server.secure.rounds import SecureRounds

__all__ = ["SecureAttempt", "SecureRounds", "StageTask"]
