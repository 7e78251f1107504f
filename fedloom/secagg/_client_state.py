"""What a SecAgg+ client holds: its attempt in progress, its key offer, and its memory of
each round across sessions (`RoundLedger`). Used by `fedloom.secagg._client`."""

from __future__ import annotations

import dataclasses

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedloom.errors import SecureAggregationError
from fedloom.secagg._crypto import generate_private_key, public_bytes
from fedloom.secagg._graph import Graph
from fedloom.secagg._identity import VerifiedPeer
from fedloom.secagg._messages import AdvertisedKeys, KeyOffer, SecAggReply, SecAggRequest, Stage
from fedloom.secagg._setup import RoundSetup


class NotThisAttempt(SecureAggregationError):
    """A request for another (older, used or foreign) round attempt."""


class DealerAccused(SecureAggregationError):
    """A share from ``dealer`` does not open, or does not match the commitment its
    dealer published: this client refuses the attempt and names the dealer."""

    def __init__(self, dealer: str, message: str) -> None:
        super().__init__(message)
        self.dealer = dealer


#: How a client's task failure names the dealer it accuses (`accusation_failure`); the
#: server reads it back with `accused_dealer`.
ACCUSATION_PREFIX = "DealerAccused "


def accusation_failure(exc: DealerAccused) -> str:
    """The task failure a client reports for ``exc``: the prefix, the dealer, the why."""
    return f"{ACCUSATION_PREFIX}{exc.dealer}: {exc}"


def accused_dealer(failure: str) -> str | None:
    """The dealer a task failure accuses (`accusation_failure`), or None."""
    if not failure.startswith(ACCUSATION_PREFIX):
        return None
    dealer, sep, _ = failure[len(ACCUSATION_PREFIX):].partition(": ")
    return dealer if sep and dealer and " " not in dealer else None


@dataclasses.dataclass(eq=False)
class Offer:
    """The private halves of the client's outstanding `KeyOffer`."""

    cipher_key: X25519PrivateKey
    mask_key: X25519PrivateKey
    public: KeyOffer


def new_offer() -> Offer:
    cipher_key, mask_key = generate_private_key(), generate_private_key()
    return Offer(cipher_key, mask_key, KeyOffer(public_bytes(cipher_key), public_bytes(mask_key)))


@dataclasses.dataclass(eq=False)
class RoundLedger:
    """What a client remembers of each round across its sessions: the newest attempt id
    it has seen, how many attempts it began, and whether its input may be in a sum the
    server unmasked (``revealed``: it revealed shares, or confirmed the survivors of an
    attempt whose input it encoded itself, distributed DP).

    A server can end a session at will (the client then joins again under a new id), so
    a client that keeps one ledger for all its sessions (`ClientRunner` does) cannot be
    led into a second unmasked attempt of a round, nor back to an older attempt, by
    starting it afresh.
    """

    latest: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)
    attempts: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)
    revealed: set[tuple[str, int]] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(eq=False)
class Attempt:
    """What one client holds during one round attempt (secrets are dropped early)."""

    setup: RoundSetup
    cipher_key: X25519PrivateKey | None
    mask_key: X25519PrivateKey | None
    self_mask_seed: bytes | None
    public_keys: tuple[bytes, bytes]  # (cipher, mask), as the server presents them
    graph: Graph = dataclasses.field(default_factory=dict)
    graph_seed: bytes = b""  # binds the roster this client was shown (shares, confirmations)
    neighbours: frozenset[str] = frozenset()
    roster: dict[str, AdvertisedKeys] = dataclasses.field(default_factory=dict)
    peers: dict[str, VerifiedPeer] = dataclasses.field(default_factory=dict)
    # neighbour -> X25519 secret of the cipher keys (agreed to seal, reused to open; as
    # secret as cipher_key, and dropped with it)
    cipher_secrets: dict[str, bytes] = dataclasses.field(default_factory=dict)
    # owner -> (share of owner's mask key, share of owner's self-mask seed)
    held: dict[str, tuple[bytes, bytes]] = dataclasses.field(default_factory=dict)
    view: tuple[str, ...] | None = None  # the survivor set this client confirmed
    # the input was encoded by the caller (distributed DP): its noise may be in one sum
    encoded: bool = False
    answered: dict[Stage, tuple[SecAggRequest, SecAggReply]] = dataclasses.field(
        default_factory=dict
    )
