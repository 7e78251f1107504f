"""The SecAgg+ stages and the messages that carry them (frozen dataclasses).

One round attempt runs four stages, each a request from the server to a client and the
client's reply (Bonawitz et al., CCS 2017, rounds 0-3; Bell et al., CCS 2020):

=================  =============================  ==============================
stage              server -> client               client -> server
=================  =============================  ==============================
advertise_keys     `AdvertiseKeysRequest`         `AdvertisedKeys`
share_keys         `ShareKeysRequest`             `ShareKeysReply`
masked_input       `MaskedInputRequest`           `MaskedInputReply`
unmask             `UnmaskRequest`                `UnmaskReply`
=================  =============================  ==============================

Key offers: every `ShareKeysReply` may carry a `KeyOffer`, two fresh public keys the
client made for its *next* round attempt (bound to no round yet). A server that holds
an unused offer from a participant skips that client's advertise_keys stage: it
presents the offered keys as the client's `AdvertisedKeys` for the new attempt, and the
client's `ShareKeysRequest` then carries the round's setup and those keys (the client
checks they are the ones it offered, and uses an offer once). When every participant
has an offer, a round attempt runs three round trips instead of four.

The messages are plain data (bytes, ints, strings, one uint32 array) so a transport can
carry them in any envelope. Constructors check only the shape of a message (types and
byte lengths) and raise `MessageRejectedError`; whether a message makes sense for the
round is the state machines' business.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
from typing import Any

import numpy as np

from fedloom.errors import ConfigError, MessageRejectedError, RejectReason
from fedloom.secagg._config import SecAggConfig
from fedloom.secagg._encoding import pack

PUBLIC_KEY_BYTES = 32
COMMITMENT_BYTES = 32
NONCE_BYTES = 12
SEED_BYTES = 32
MAX_ID_LENGTH = 256
#: Masks are AES-CTR keystreams with a 32-bit block counter: 2**32 blocks of 4 words.
MAX_VECTOR_LENGTH = 1 << 34


class Stage(enum.StrEnum):
    """The four SecAgg+ stages, in order."""

    ADVERTISE_KEYS = "advertise_keys"
    SHARE_KEYS = "share_keys"
    MASKED_INPUT = "masked_input"
    UNMASK = "unmask"


def _invalid(message: str) -> MessageRejectedError:
    return MessageRejectedError(RejectReason.INVALID, message)


def _check_id(value: Any, what: str) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_LENGTH:
        raise _invalid(f"{what} must be a client id of 1..{MAX_ID_LENGTH} characters")


def _check_bytes(value: Any, length: int, what: str) -> None:
    if not isinstance(value, bytes) or len(value) != length:
        raise _invalid(f"{what} must be {length} bytes")


def _check_int(value: Any, what: str, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _invalid(f"{what} must be an integer >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class RoundId:
    """Names one round attempt: a restarted round gets a new ``attempt`` (and new keys)."""

    run_id: str
    server_round: int
    attempt: int

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not 0 < len(self.run_id) <= MAX_ID_LENGTH:
            raise _invalid(f"run_id must be a string of 1..{MAX_ID_LENGTH} characters")
        _check_int(self.server_round, "server_round")
        _check_int(self.attempt, "attempt")

    def encode(self) -> bytes:
        return pack(self.run_id, self.server_round, self.attempt)


@dataclasses.dataclass(frozen=True, slots=True)
class RoundSetup:
    """The public parameters of one round attempt, sent to every participant.

    ``participants`` is sorted; a client's Shamir x-coordinate is its position plus one.
    ``vector_length`` is the length of the float vector a client contributes; the masked
    vector has one more element (the weight). Build one with `RoundSetup.create`.
    """

    round_id: RoundId
    participants: tuple[str, ...]
    neighbours: int
    threshold: int
    clip_range: float
    bits: int
    max_weight: float
    vector_length: int
    graph_seed: bytes
    digest: bytes = dataclasses.field(init=False, repr=False, compare=False)
    #: ``pack(round_id.encode(), digest)``: the prefix every derivation of the attempt
    #: binds (computed once; `pack` of more fields is this plus their encodings)
    binding: bytes = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.round_id, RoundId):
            raise _invalid("round_id must be a RoundId")
        if not isinstance(self.participants, tuple):
            raise _invalid("participants must be a tuple of client ids")
        for pid in self.participants:
            _check_id(pid, "participant")
        if list(self.participants) != sorted(set(self.participants)):
            raise _invalid("participants must be sorted and unique")
        _check_int(self.vector_length, "vector_length", minimum=1)
        if self.vector_length + 1 > MAX_VECTOR_LENGTH:
            raise _invalid(f"vector_length must be below {MAX_VECTOR_LENGTH}")
        _check_bytes(self.graph_seed, SEED_BYTES, "graph_seed")
        for name in ("clip_range", "max_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value):
                raise _invalid(f"{name} must be a finite float")
        try:
            self.config().check_round_size(len(self.participants))
        except ConfigError as exc:
            raise _invalid(f"round parameters refused: {exc}") from exc
        object.__setattr__(self, "digest", hashlib.sha256(self._encode()).digest())
        object.__setattr__(self, "binding", pack(self.round_id.encode(), self.digest))

    @classmethod
    def create(
        cls,
        config: SecAggConfig,
        round_id: RoundId,
        participants: tuple[str, ...] | list[str] | frozenset[str],
        vector_length: int,
        graph_seed: bytes | None = None,
    ) -> RoundSetup:
        """Set up a round attempt from the server's configuration.

        ``graph_seed`` defaults to a hash of ``round_id`` (public and deterministic).
        Raises `ConfigError` when the round is larger than ``max_participants`` or too
        small for the threshold.
        """
        ids = tuple(sorted(set(participants)))
        config.check_round_size(len(ids))
        seed = graph_seed or hashlib.sha256(b"fedloom/secagg/v1/graph" + round_id.encode()).digest()
        return cls(
            round_id=round_id,
            participants=ids,
            neighbours=config.neighbours,
            threshold=config.threshold,
            clip_range=float(config.clip_range),
            bits=config.bits,
            max_weight=float(config.max_weight),
            vector_length=vector_length,
            graph_seed=seed,
        )

    def config(self) -> SecAggConfig:
        """These parameters as a (validated) `SecAggConfig`."""
        return SecAggConfig(
            enabled=True,
            neighbours=self.neighbours,
            threshold=self.threshold,
            clip_range=self.clip_range,
            bits=self.bits,
            max_weight=self.max_weight,
            max_participants=max(2, len(self.participants)),
        )

    @property
    def masked_length(self) -> int:
        """Length of a masked vector: the weighted delta plus the weight."""
        return self.vector_length + 1

    def x_coordinate(self, client_id: str) -> int:
        """The client's Shamir x-coordinate (its 1-based position in ``participants``)."""
        lo, hi = 0, len(self.participants)
        while lo < hi:  # binary search in the sorted tuple
            mid = (lo + hi) // 2
            if self.participants[mid] < client_id:
                lo = mid + 1
            else:
                hi = mid
        if lo == len(self.participants) or self.participants[lo] != client_id:
            raise KeyError(client_id)
        return lo + 1

    def _encode(self) -> bytes:
        return b"fedloom/secagg/v1/setup" + pack(
            self.round_id.encode(),
            len(self.participants),
            *self.participants,
            self.neighbours,
            self.threshold,
            self.clip_range,
            self.bits,
            self.max_weight,
            self.vector_length,
            self.graph_seed,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class AdvertiseKeysRequest:
    """Stage advertise_keys, server -> every participant: the round's parameters."""

    setup: RoundSetup

    @property
    def round_id(self) -> RoundId:
        return self.setup.round_id


def _check_key_pair(cipher_public_key: Any, mask_public_key: Any) -> None:
    _check_bytes(cipher_public_key, PUBLIC_KEY_BYTES, "cipher_public_key")
    _check_bytes(mask_public_key, PUBLIC_KEY_BYTES, "mask_public_key")
    if cipher_public_key == mask_public_key:
        raise _invalid("the cipher and mask public keys must differ")


@dataclasses.dataclass(frozen=True, slots=True)
class AdvertisedKeys:
    """Stage advertise_keys, client -> server: two fresh X25519 public keys.

    ``cipher_public_key`` agrees the key that encrypts shares between two neighbours;
    ``mask_public_key`` agrees their pairwise mask seed (its secret is Shamir-shared).
    The server also builds one from a client's `KeyOffer` when it skips the stage.
    """

    round_id: RoundId
    client_id: str
    cipher_public_key: bytes
    mask_public_key: bytes

    def __post_init__(self) -> None:
        _check_id(self.client_id, "client_id")
        _check_key_pair(self.cipher_public_key, self.mask_public_key)


@dataclasses.dataclass(frozen=True, slots=True)
class KeyOffer:
    """Two fresh X25519 public keys a client made for its next round attempt.

    Sent with a `ShareKeysReply`; bound to no round until the server uses it. The
    client keeps the private halves of its latest offer only, and uses them for one
    attempt at most.
    """

    cipher_public_key: bytes
    mask_public_key: bytes

    def __post_init__(self) -> None:
        _check_key_pair(self.cipher_public_key, self.mask_public_key)

    def advertised(self, round_id: RoundId, client_id: str) -> AdvertisedKeys:
        """These keys as ``client_id``'s advertised keys for the attempt ``round_id``."""
        return AdvertisedKeys(round_id, client_id, self.cipher_public_key, self.mask_public_key)


@dataclasses.dataclass(frozen=True, slots=True)
class ShareKeysRequest:
    """Stage share_keys, server -> client: the advertised keys of its neighbours.

    ``setup`` and ``own_keys`` are set when the server skipped this client's
    advertise_keys stage: the round's parameters (not seen yet) and the keys of the
    client's `KeyOffer` the server presents as its own for this attempt.
    """

    round_id: RoundId
    neighbours: tuple[AdvertisedKeys, ...]
    setup: RoundSetup | None = None
    own_keys: AdvertisedKeys | None = None

    def __post_init__(self) -> None:
        if (self.setup is None) != (self.own_keys is None):
            raise _invalid("a share-keys request carries both the setup and the client's "
                           "own keys, or neither")
        if self.setup is not None and self.setup.round_id != self.round_id:
            raise _invalid("a share-keys request's setup names another round attempt")


@dataclasses.dataclass(frozen=True, slots=True)
class EncryptedShare:
    """A client's two Shamir shares for one neighbour, sealed for that neighbour.

    ChaCha20-Poly1305 under a key only the two clients can derive; the associated data
    binds the setup (run, round, attempt, participants), the sender and the receiver.
    """

    sender: str
    receiver: str
    nonce: bytes
    ciphertext: bytes

    def __post_init__(self) -> None:
        _check_id(self.sender, "sender")
        _check_id(self.receiver, "receiver")
        _check_bytes(self.nonce, NONCE_BYTES, "nonce")
        if not isinstance(self.ciphertext, bytes) or len(self.ciphertext) > 4096:
            raise _invalid("ciphertext must be at most 4096 bytes")


@dataclasses.dataclass(frozen=True, slots=True)
class ShareKeysReply:
    """Stage share_keys, client -> server: one `EncryptedShare` per neighbour.

    ``self_mask_commitment`` is SHA-256 over the setup, the client id and the self-mask
    seed it has just shared, so that the server can check a reconstructed seed.
    ``next_keys``: the client's offer of keys for its next round attempt (optional).
    """

    round_id: RoundId
    client_id: str
    shares: tuple[EncryptedShare, ...]
    self_mask_commitment: bytes
    next_keys: KeyOffer | None = None

    def __post_init__(self) -> None:
        _check_id(self.client_id, "client_id")
        _check_bytes(self.self_mask_commitment, COMMITMENT_BYTES, "self_mask_commitment")
        if self.next_keys is not None and not isinstance(self.next_keys, KeyOffer):
            raise _invalid("next_keys must be a KeyOffer")


@dataclasses.dataclass(frozen=True, slots=True)
class MaskedInputRequest:
    """Stage masked_input, server -> client: the shares its neighbours sealed for it."""

    round_id: RoundId
    shares: tuple[EncryptedShare, ...]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class MaskedInputReply:
    """Stage masked_input, client -> server: ``masked`` is uint32 of ``masked_length``.

    ``masked = q(w * clip(delta)) ++ [q(w)] + PRG(b_u) + sum_v +-PRG(s_uv)  (mod 2**32)``.
    Compared by identity (it holds an array); treat ``masked`` as read-only.
    """

    round_id: RoundId
    client_id: str
    masked: np.ndarray

    def __post_init__(self) -> None:
        _check_id(self.client_id, "client_id")
        if not isinstance(self.masked, np.ndarray):
            raise _invalid("masked must be a numpy array")


@dataclasses.dataclass(frozen=True, slots=True)
class UnmaskRequest:
    """Stage unmask, server -> survivor: which of its neighbours survived or dropped.

    ``survivors`` are neighbours whose masked input the server accepted (their
    self-mask shares are requested); ``dropped`` shared keys but sent no accepted masked
    input (their mask-key shares are requested).
    """

    round_id: RoundId
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class RevealedShare:
    """One Shamir share (y value) of ``owner``'s secret, as revealed in unmask."""

    owner: str
    value: bytes

    def __post_init__(self) -> None:
        _check_id(self.owner, "owner")
        if not isinstance(self.value, bytes) or len(self.value) > 128:
            raise _invalid("a share value must be at most 128 bytes")


@dataclasses.dataclass(frozen=True, slots=True)
class UnmaskReply:
    """Stage unmask, client -> server: shares of survivors' self-mask seeds and of
    dropped clients' mask keys."""

    round_id: RoundId
    client_id: str
    self_mask_shares: tuple[RevealedShare, ...]
    mask_key_shares: tuple[RevealedShare, ...]

    def __post_init__(self) -> None:
        _check_id(self.client_id, "client_id")


SecAggRequest = AdvertiseKeysRequest | ShareKeysRequest | MaskedInputRequest | UnmaskRequest
SecAggReply = AdvertisedKeys | ShareKeysReply | MaskedInputReply | UnmaskReply

#: The stage each message belongs to.
STAGE_OF: dict[type, Stage] = {
    AdvertiseKeysRequest: Stage.ADVERTISE_KEYS,
    AdvertisedKeys: Stage.ADVERTISE_KEYS,
    ShareKeysRequest: Stage.SHARE_KEYS,
    ShareKeysReply: Stage.SHARE_KEYS,
    MaskedInputRequest: Stage.MASKED_INPUT,
    MaskedInputReply: Stage.MASKED_INPUT,
    UnmaskRequest: Stage.UNMASK,
    UnmaskReply: Stage.UNMASK,
}
