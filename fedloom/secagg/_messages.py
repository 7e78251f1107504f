"""The SecAgg+ stages and the messages that carry them (frozen dataclasses).

One round attempt runs up to five stages, each a request from the server to a client
and the client's reply (Bonawitz et al., CCS 2017, rounds 0-4, with the consistency
check of their actively secure protocol; Bell et al., CCS 2020, for the sparse graph):

=================  =============================  ==============================
stage              server -> client               client -> server
=================  =============================  ==============================
advertise_keys     `AdvertiseKeysRequest`         `AdvertisedKeys`
share_keys         `ShareKeysRequest`             `ShareKeysReply`
masked_input       `MaskedInputRequest`           `MaskedInputReply`
consistency        `ConsistencyRequest`           `ConsistencyReply`
unmask             `UnmaskRequest`                `UnmaskReply`
=================  =============================  ==============================

The consistency stage runs only in *authenticated* attempts (``RoundSetup.authenticated``:
clients hold certificates of a client CA and sign their keys and the survivor set they
confirm); it is what keeps a server that lies about who survived from unmasking anyone.
An unauthenticated attempt (honest-but-curious server only) goes from masked input to
unmask, and may skip advertise_keys with key offers: every `ShareKeysReply` may carry a
`KeyOffer`, two fresh public keys the client made for its *next* attempt, which the
server presents as its advertised keys then. Authenticated attempts never use offers:
their keys are made after the client has seen the attempt's setup, so the neighbour
graph, derived from every participant's keys, is not known to the server when it picks
the participants.

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
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedloom.errors import ConfigError, MessageRejectedError, RejectReason
from fedloom.secagg._config import SecAggConfig
from fedloom.secagg._encoding import PROTOCOL_LABEL, pack
from fedloom.secagg._identity import MAX_CERTIFICATE_BYTES, MAX_SIGNATURE_BYTES
from fedloom.weights import TensorSpec

PUBLIC_KEY_BYTES = 32
COMMITMENT_BYTES = 32
DIGEST_BYTES = 32
NONCE_BYTES = 12
SEED_BYTES = 32
MAX_ID_LENGTH = 256
#: Masks are AES-CTR keystreams with a 32-bit block counter: 2**32 blocks of 4 words.
MAX_VECTOR_LENGTH = 1 << 34


class Stage(enum.StrEnum):
    """The SecAgg+ stages, in order (consistency: authenticated attempts only)."""

    ADVERTISE_KEYS = "advertise_keys"
    SHARE_KEYS = "share_keys"
    MASKED_INPUT = "masked_input"
    CONSISTENCY = "consistency"
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


def _check_ids(values: Any, what: str) -> None:
    if not isinstance(values, tuple):
        raise _invalid(f"{what} must be a tuple of client ids")
    for value in values:
        _check_id(value, what)
    if list(values) != sorted(set(values)):
        raise _invalid(f"{what} must be sorted and unique")


def config_digest(config: Mapping[str, Any]) -> bytes:
    """SHA-256 of a fit config in a canonical encoding (keys sorted, values typed).

    Bound into the round's setup, so every participant trains with the same config.
    """
    parts: list[str | bytes | int | float] = [len(config)]
    for key in sorted(config):
        value = config[key]
        # by the wire's types: a subclass (an IntEnum, numpy's float64) arrives as its base
        plain: str | bytes | int | float
        if isinstance(value, bool):  # before int: bool is an int subclass
            kind, plain = "bool", int(value)
        elif isinstance(value, int):
            kind, plain = "int", int(value)
            if not -(1 << 63) <= plain < 1 << 63:
                raise ValueError(f"fit config value {key!r} does not fit in 64 bits")
        elif isinstance(value, float):
            kind, plain = "float", float(value)
        elif isinstance(value, str):
            kind, plain = "str", str(value)
        elif isinstance(value, bytes):
            kind, plain = "bytes", bytes(value)
        else:
            raise TypeError(f"fit config value {key!r} is a {type(value).__name__}")
        parts += [key, kind, plain]
    return hashlib.sha256(PROTOCOL_LABEL + b"fit-config" + pack(*parts)).digest()


def model_digest(specs: Sequence[TensorSpec], payload_sha256: bytes) -> bytes:
    """SHA-256 binding a model's layout (names, dtypes, shapes) and its bytes' SHA-256.

    Bound into the round's setup, so every participant trains on the same global model:
    a server that sends one client another model makes that client's setup differ from
    its neighbours', and every key, share and signature of the attempt with it.
    """
    parts: list[str | bytes | int] = [len(specs)]
    for spec in specs:
        parts += [spec.name, spec.dtype, len(spec.shape), *spec.shape]
    parts.append(payload_sha256)
    return hashlib.sha256(PROTOCOL_LABEL + b"model" + pack(*parts)).digest()


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

    ``participants`` is sorted; a client's Shamir x-coordinate is its position plus one,
    and ``identities`` names each participant's identity in the same order (the name its
    client certificate carries, in an ``authenticated`` attempt, where no identity may
    be seated twice). ``vector_length`` is the length of the float vector a client
    contributes; the masked vector has one more element (the weight).
    ``min_survivors``: clients refuse to unmask a sum over fewer survivors.
    ``model_digest`` / ``config_digest`` (`model_digest`, `config_digest`) bind the
    global model and fit config the masked-input stage delivers. The neighbour graph is
    not part of the setup: every party derives it from the setup and the keys every
    participant advertised (`fedloom.secagg.graph_seed`). Build one with
    `RoundSetup.create`.
    """

    round_id: RoundId
    participants: tuple[str, ...]
    identities: tuple[str, ...]
    neighbours: int
    threshold: int
    clip_range: float
    bits: int
    max_weight: float
    vector_length: int
    min_survivors: int
    model_digest: bytes
    config_digest: bytes
    authenticated: bool
    digest: bytes = dataclasses.field(init=False, repr=False, compare=False)
    #: ``pack(round_id.encode(), digest)``: the prefix every derivation of the attempt
    #: binds (computed once; `pack` of more fields is this plus their encodings)
    binding: bytes = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.round_id, RoundId):
            raise _invalid("round_id must be a RoundId")
        _check_ids(self.participants, "participants")
        if not isinstance(self.identities, tuple) or len(self.identities) != len(
                self.participants):
            raise _invalid("identities must name every participant, in participant order")
        for name in self.identities:
            _check_id(name, "identity")
        if not isinstance(self.authenticated, bool):
            raise _invalid("authenticated must be a bool")
        if self.authenticated and len(set(self.identities)) != len(self.identities):
            raise _invalid("an authenticated round seats every identity once (two "
                           "participants claim one certificate's name)")
        _check_int(self.vector_length, "vector_length", minimum=1)
        if self.vector_length + 1 > MAX_VECTOR_LENGTH:
            raise _invalid(f"vector_length must be below {MAX_VECTOR_LENGTH}")
        _check_bytes(self.model_digest, DIGEST_BYTES, "model_digest")
        _check_bytes(self.config_digest, DIGEST_BYTES, "config_digest")
        for name in ("clip_range", "max_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value):
                raise _invalid(f"{name} must be a finite float")
        _check_int(self.min_survivors, "min_survivors")
        try:
            self.config().check_round_size(len(self.participants))
        except ConfigError as exc:
            raise _invalid(f"round parameters refused: {exc}") from exc
        if not self.threshold + 1 <= self.min_survivors <= len(self.participants):
            raise _invalid(f"min_survivors ({self.min_survivors}) must be between threshold + 1 "
                           f"({self.threshold + 1}) and the number of participants "
                           f"({len(self.participants)})")
        object.__setattr__(self, "digest", hashlib.sha256(self._encode()).digest())
        object.__setattr__(self, "binding", pack(self.round_id.encode(), self.digest))

    @classmethod
    def create(
        cls,
        config: SecAggConfig,
        round_id: RoundId,
        participants: Sequence[str] | frozenset[str],
        vector_length: int,
        *,
        model_digest: bytes,
        config_digest: bytes,
        identities: Mapping[str, str] | None = None,
        authenticated: bool = False,
    ) -> RoundSetup:
        """Set up a round attempt from the server's configuration.

        ``identities`` maps each participant to its identity (its certificate's name in
        an authenticated round); by default a participant's id is its identity.
        Raises `ConfigError` when the round is larger than ``max_participants`` or too
        small for the threshold or the survivor floor.
        """
        ids = tuple(sorted(set(participants)))
        config.check_round_size(len(ids))
        floor = config.survivor_floor
        if len(ids) < floor:
            raise ConfigError("secure_aggregation.min_survivors",
                              f"a round of {len(ids)} clients cannot reach the survivor floor "
                              f"of {floor}: sample more clients or lower min_survivors")
        names = identities or {}
        return cls(
            round_id=round_id,
            participants=ids,
            identities=tuple(names.get(pid, pid) for pid in ids),
            neighbours=config.neighbours,
            threshold=config.threshold,
            clip_range=float(config.clip_range),
            bits=config.bits,
            max_weight=float(config.max_weight),
            vector_length=vector_length,
            min_survivors=floor,
            model_digest=model_digest,
            config_digest=config_digest,
            authenticated=authenticated,
        )

    def config(self) -> SecAggConfig:
        """The protocol parameters as a (validated) `SecAggConfig`."""
        return SecAggConfig(
            enabled=True,
            neighbours=self.neighbours,
            threshold=self.threshold,
            clip_range=self.clip_range,
            bits=self.bits,
            max_weight=self.max_weight,
            max_participants=max(2, len(self.participants)),
            colluding_clients=0,  # an assumption of the deployment, not a round parameter
        )

    @property
    def masked_length(self) -> int:
        """Length of a masked vector: the weighted delta plus the weight."""
        return self.vector_length + 1

    def index(self, client_id: str) -> int:
        """The client's 0-based position in ``participants`` (`KeyError` if absent)."""
        lo, hi = 0, len(self.participants)
        while lo < hi:  # binary search in the sorted tuple
            mid = (lo + hi) // 2
            if self.participants[mid] < client_id:
                lo = mid + 1
            else:
                hi = mid
        if lo == len(self.participants) or self.participants[lo] != client_id:
            raise KeyError(client_id)
        return lo

    def x_coordinate(self, client_id: str) -> int:
        """The client's Shamir x-coordinate (its 1-based position in ``participants``)."""
        return self.index(client_id) + 1

    def identity_of(self, client_id: str) -> str:
        """The identity the setup seats as ``client_id``."""
        return self.identities[self.index(client_id)]

    def _encode(self) -> bytes:
        return PROTOCOL_LABEL + b"setup" + pack(
            self.round_id.encode(),
            len(self.participants),
            *self.participants,
            *self.identities,
            self.neighbours,
            self.threshold,
            self.clip_range,
            self.bits,
            self.max_weight,
            self.vector_length,
            self.min_survivors,
            self.model_digest,
            self.config_digest,
            int(self.authenticated),
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


def _check_signature(value: Any, what: str, *, optional: bool = False) -> None:
    if not isinstance(value, bytes) or len(value) > MAX_SIGNATURE_BYTES or (
            not value and not optional):
        raise _invalid(f"{what} must be 1..{MAX_SIGNATURE_BYTES} bytes")


@dataclasses.dataclass(frozen=True, slots=True)
class AdvertisedKeys:
    """Stage advertise_keys, client -> server: two fresh X25519 public keys.

    ``cipher_public_key`` agrees the key that encrypts shares between two neighbours;
    ``mask_public_key`` agrees their pairwise mask seed (its secret is Shamir-shared).
    In an authenticated attempt ``certificate`` is the client's certificate (DER) and
    ``signature`` its signature of `fedloom.secagg.key_statement` (the two keys bound to
    the attempt's setup, the client's id and identity); both are empty otherwise. The
    server also builds one from a client's `KeyOffer` when it skips the stage.
    """

    round_id: RoundId
    client_id: str
    cipher_public_key: bytes
    mask_public_key: bytes
    certificate: bytes = b""
    signature: bytes = b""

    def __post_init__(self) -> None:
        _check_id(self.client_id, "client_id")
        _check_key_pair(self.cipher_public_key, self.mask_public_key)
        if not isinstance(self.certificate, bytes) or len(self.certificate) > \
                MAX_CERTIFICATE_BYTES:
            raise _invalid(f"certificate must be at most {MAX_CERTIFICATE_BYTES} bytes")
        _check_signature(self.signature, "signature", optional=True)
        if bool(self.certificate) != bool(self.signature):
            raise _invalid("signed keys carry both the certificate and the signature")

    @property
    def signed(self) -> bool:
        return bool(self.signature)


@dataclasses.dataclass(frozen=True, slots=True)
class KeyOffer:
    """Two fresh X25519 public keys a client made for its next round attempt.

    Sent with a `ShareKeysReply` of an unauthenticated attempt; bound to no round until
    the server uses it. The client keeps the private halves of its latest offer only,
    and uses them for one attempt at most.
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
    """Stage share_keys, server -> client: the keys every participant advertised.

    ``roster`` holds the advertised keys of every participant that advertised, sorted by
    client id (the client's own included): each client derives the neighbour graph from
    them (`graph_seed`) and checks every signature, so the server can neither choose
    the graph nor slip in a key. ``setup`` and ``own_keys`` are set when the server
    skipped this client's advertise_keys stage (an unauthenticated attempt on a key
    offer): the round's parameters (not seen yet) and the keys of the client's
    `KeyOffer` the server presents as its own for this attempt.
    """

    round_id: RoundId
    roster: tuple[AdvertisedKeys, ...]
    setup: RoundSetup | None = None
    own_keys: AdvertisedKeys | None = None

    def __post_init__(self) -> None:
        if (self.setup is None) != (self.own_keys is None):
            raise _invalid("a share-keys request carries both the setup and the client's "
                           "own keys, or neither")
        if self.setup is not None and self.setup.round_id != self.round_id:
            raise _invalid("a share-keys request's setup names another round attempt")
        ids = [keys.client_id for keys in self.roster]
        if ids != sorted(set(ids)):
            raise _invalid("the roster must be sorted by client id, each client once")


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
class ShareCommitment:
    """Commitments to the two shares a client dealt to ``holder`` (`commit_share`).

    The dealer publishes them with its shares; the holder checks the shares it opens
    against them, and the server checks every share revealed in unmask against them,
    so a corrupted share is caught and blamed on the client that sent it.
    """

    holder: str
    mask_key: bytes
    self_mask: bytes

    def __post_init__(self) -> None:
        _check_id(self.holder, "holder")
        _check_bytes(self.mask_key, COMMITMENT_BYTES, "mask_key commitment")
        _check_bytes(self.self_mask, COMMITMENT_BYTES, "self_mask commitment")


@dataclasses.dataclass(frozen=True, slots=True)
class ShareKeysReply:
    """Stage share_keys, client -> server: one `EncryptedShare` per neighbour.

    ``self_mask_commitment`` is SHA-256 over the setup, the client id and the self-mask
    seed it has just shared, so that the server can check a reconstructed seed;
    ``share_commitments`` commits to each dealt share (one per neighbour, in the order
    of ``shares``). ``next_keys``: the client's offer of keys for its next
    (unauthenticated) attempt, optional.
    """

    round_id: RoundId
    client_id: str
    shares: tuple[EncryptedShare, ...]
    self_mask_commitment: bytes
    share_commitments: tuple[ShareCommitment, ...]
    next_keys: KeyOffer | None = None

    def __post_init__(self) -> None:
        _check_id(self.client_id, "client_id")
        _check_bytes(self.self_mask_commitment, COMMITMENT_BYTES, "self_mask_commitment")
        if [c.holder for c in self.share_commitments] != [s.receiver for s in self.shares]:
            raise _invalid("share_commitments must name the receivers of the shares, in order")
        if self.next_keys is not None and not isinstance(self.next_keys, KeyOffer):
            raise _invalid("next_keys must be a KeyOffer")


@dataclasses.dataclass(frozen=True, slots=True)
class MaskedInputRequest:
    """Stage masked_input, server -> client: the shares its neighbours sealed for it,
    each with the commitments its dealer published for it (``commitments[i]`` belongs
    to ``shares[i]``)."""

    round_id: RoundId
    shares: tuple[EncryptedShare, ...]
    commitments: tuple[ShareCommitment, ...]

    def __post_init__(self) -> None:
        if len(self.shares) != len(self.commitments) or any(
                c.holder != s.receiver for s, c in zip(self.shares, self.commitments,
                                                       strict=True)):
            raise _invalid("every share comes with its dealer's commitments for its receiver")


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
class ConsistencyRequest:
    """Stage consistency, server -> survivor: the survivor set the server will unmask.

    ``survivors``: every client whose masked input the server accepted, sorted. A client
    checks it (it is in it; it holds the shares of each neighbour in it; at least the
    threshold of its neighbours are in it; the set reaches ``min_survivors`` and is
    connected in the graph) and signs it (`survivors_statement`).
    """

    round_id: RoundId
    survivors: tuple[str, ...]

    def __post_init__(self) -> None:
        _check_ids(self.survivors, "survivors")


@dataclasses.dataclass(frozen=True, slots=True)
class ConsistencyReply:
    """Stage consistency, client -> server: its signature of the survivor set."""

    round_id: RoundId
    client_id: str
    signature: bytes

    def __post_init__(self) -> None:
        _check_id(self.client_id, "client_id")
        _check_signature(self.signature, "signature")


@dataclasses.dataclass(frozen=True, slots=True)
class Confirmation:
    """A neighbour's signature of the survivor set (from its `ConsistencyReply`)."""

    signer: str
    signature: bytes

    def __post_init__(self) -> None:
        _check_id(self.signer, "signer")
        _check_signature(self.signature, "signature")


@dataclasses.dataclass(frozen=True, slots=True)
class UnmaskRequest:
    """Stage unmask, server -> survivor: the survivor set, and its neighbours' proof.

    ``survivors``: the clients whose masked input is in the sum (in an authenticated
    attempt, the set this client confirmed). The client reveals, for each neighbour
    whose shares it holds, the self-mask share of a survivor or the mask-key share of a
    neighbour that is not one. ``confirmations`` (authenticated attempts): the
    signatures of the survivor set by this client's neighbours that signed it; the
    client needs at least the threshold of them, and reveals a survivor's self-mask
    share only when that survivor's own confirmation is among them.
    """

    round_id: RoundId
    survivors: tuple[str, ...]
    confirmations: tuple[Confirmation, ...] = ()

    def __post_init__(self) -> None:
        _check_ids(self.survivors, "survivors")
        signers = [c.signer for c in self.confirmations]
        if len(set(signers)) != len(signers):
            raise _invalid("a confirmation is listed twice")


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


SecAggRequest = (AdvertiseKeysRequest | ShareKeysRequest | MaskedInputRequest
                 | ConsistencyRequest | UnmaskRequest)
SecAggReply = (AdvertisedKeys | ShareKeysReply | MaskedInputReply | ConsistencyReply
               | UnmaskReply)

#: The stage each message belongs to.
STAGE_OF: dict[type, Stage] = {
    AdvertiseKeysRequest: Stage.ADVERTISE_KEYS,
    AdvertisedKeys: Stage.ADVERTISE_KEYS,
    ShareKeysRequest: Stage.SHARE_KEYS,
    ShareKeysReply: Stage.SHARE_KEYS,
    MaskedInputRequest: Stage.MASKED_INPUT,
    MaskedInputReply: Stage.MASKED_INPUT,
    ConsistencyRequest: Stage.CONSISTENCY,
    ConsistencyReply: Stage.CONSISTENCY,
    UnmaskRequest: Stage.UNMASK,
    UnmaskReply: Stage.UNMASK,
}
