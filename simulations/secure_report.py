"""What a simulated secure round did and cost: `SecureRoundReport`, `payload_bytes`.

Filled by `fedloom.simulations.local_secure.LocalSecureAggregation`, one report per round.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedloom.secagg import (
    AdvertisedKeys,
    AdvertiseKeysRequest,
    ConsistencyReply,
    ConsistencyRequest,
    EncryptedShare,
    MaskedInputReply,
    MaskedInputRequest,
    ShareKeysReply,
    ShareKeysRequest,
    UnmaskReply,
    UnmaskRequest,
)


@dataclasses.dataclass
class SecureRoundReport:
    """What one simulated secure round did and cost (`LocalSecureAggregation.reports`).

    ``stage_s`` is the wall time of each stage (every client's work and the server's),
    summed over the round's attempts; ``client_cpu_s`` the CPU seconds summed over the
    clients per stage, ``"train"`` included; ``bytes_sent`` each client's upload as the
    payload of its replies (ids, keys, certificates, signatures, sealed shares and their
    commitments, the uint32 masked vector, revealed shares; no envelope). ``attempts``
    counts the round's attempts and ``failures`` says why each failed one failed.
    """

    server_round: int
    attempt: int
    attempts: int = 0
    participants: tuple[str, ...] = ()
    survivors: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    vanished: tuple[str, ...] = ()
    failure: str = ""
    failures: list[str] = dataclasses.field(default_factory=list)
    stage_s: dict[str, float] = dataclasses.field(default_factory=dict)
    client_cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)
    bytes_sent: dict[str, int] = dataclasses.field(default_factory=dict)


def payload_bytes(message: Any) -> int:
    """Bytes of a SecAgg+ message's payload fields (ids as UTF-8; no envelope)."""
    if isinstance(message, AdvertiseKeysRequest):
        setup = message.setup
        return (sum(len(p) for p in setup.participants)
                + sum(len(i) for i in setup.identities) + 2 * 32 + 8 * 8)
    if isinstance(message, AdvertisedKeys):
        return len(message.client_id) + 64 + len(message.certificate) + len(message.signature)
    if isinstance(message, ShareKeysRequest):
        return sum(payload_bytes(k) for k in message.roster)
    if isinstance(message, EncryptedShare):
        return len(message.sender) + len(message.receiver) + 12 + len(message.ciphertext)
    if isinstance(message, ShareKeysReply):
        return sum(payload_bytes(s) + 64 for s in message.shares) + 32
    if isinstance(message, MaskedInputRequest):
        return sum(payload_bytes(s) + 64 for s in message.shares)
    if isinstance(message, MaskedInputReply):
        return len(message.client_id) + message.masked.nbytes
    if isinstance(message, ConsistencyRequest):
        return sum(len(c) for c in message.survivors)
    if isinstance(message, ConsistencyReply):
        return len(message.client_id) + len(message.signature)
    if isinstance(message, UnmaskRequest):
        return (sum(len(c) for c in message.survivors)
                + sum(len(c.signer) + len(c.signature) for c in message.confirmations))
    if isinstance(message, UnmaskReply):
        return sum(len(s.owner) + len(s.value)
                   for s in (*message.self_mask_shares, *message.mask_key_shares))
    raise TypeError(f"not a SecAgg+ message: {type(message).__name__}")
