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

The round's setup (`RoundId`, `RoundSetup`, the model and config digests it binds) is in
`fedloom.secagg._setup`. The messages are plain data (bytes, ints, strings, one uint32
array) so a transport can carry them in any envelope. Constructors check only the shape
of a message (types and byte lengths) and raise `MessageRejectedError`; whether a message
makes sense for the round is the state machines' business.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

from fedloom.secagg._identity import MAX_CERTIFICATE_BYTES, MAX_SIGNATURE_BYTES
from fedloom.secagg._setup import (
    COMMITMENT_BYTES,
    NONCE_BYTES,
    PUBLIC_KEY_BYTES,
    RoundId,
    RoundSetup,
    check_bytes,
    check_id,
    check_ids,
    invalid,
)


class Stage(enum.StrEnum):
    """The SecAgg+ stages, in order (consistency: authenticated attempts only)."""

    ADVERTISE_KEYS = "advertise_keys"
    SHARE_KEYS = "share_keys"
    MASKED_INPUT = "masked_input"
    CONSISTENCY = "consistency"
    UNMASK = "unmask"


@dataclasses.dataclass(frozen=True, slots=True)
class AdvertiseKeysRequest:
    """Stage advertise_keys, server -> every participant: the round's parameters."""

    setup: RoundSetup

    @property
    def round_id(self) -> RoundId:
        return self.setup.round_id


def _check_key_pair(cipher_public_key: Any, mask_public_key: Any) -> None:
    check_bytes(cipher_public_key, PUBLIC_KEY_BYTES, "cipher_public_key")
    check_bytes(mask_public_key, PUBLIC_KEY_BYTES, "mask_public_key")
    if cipher_public_key == mask_public_key:
        raise invalid("the cipher and mask public keys must differ")


def _check_signature(value: Any, what: str, *, optional: bool = False) -> None:
    if not isinstance(value, bytes) or len(value) > MAX_SIGNATURE_BYTES or (
            not value and not optional):
        raise invalid(f"{what} must be 1..{MAX_SIGNATURE_BYTES} bytes")


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
        check_id(self.client_id, "client_id")
        _check_key_pair(self.cipher_public_key, self.mask_public_key)
        if not isinstance(self.certificate, bytes) or len(self.certificate) > \
                MAX_CERTIFICATE_BYTES:
            raise invalid(f"certificate must be at most {MAX_CERTIFICATE_BYTES} bytes")
        _check_signature(self.signature, "signature", optional=True)
        if bool(self.certificate) != bool(self.signature):
            raise invalid("signed keys carry both the certificate and the signature")

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
            raise invalid("a share-keys request carries both the setup and the client's "
                           "own keys, or neither")
        if self.setup is not None and self.setup.round_id != self.round_id:
            raise invalid("a share-keys request's setup names another round attempt")
        ids = [keys.client_id for keys in self.roster]
        if ids != sorted(set(ids)):
            raise invalid("the roster must be sorted by client id, each client once")


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
        check_id(self.sender, "sender")
        check_id(self.receiver, "receiver")
        check_bytes(self.nonce, NONCE_BYTES, "nonce")
        if not isinstance(self.ciphertext, bytes) or len(self.ciphertext) > 4096:
            raise invalid("ciphertext must be at most 4096 bytes")


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
        check_id(self.holder, "holder")
        check_bytes(self.mask_key, COMMITMENT_BYTES, "mask_key commitment")
        check_bytes(self.self_mask, COMMITMENT_BYTES, "self_mask commitment")


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
        check_id(self.client_id, "client_id")
        check_bytes(self.self_mask_commitment, COMMITMENT_BYTES, "self_mask_commitment")
        if [c.holder for c in self.share_commitments] != [s.receiver for s in self.shares]:
            raise invalid("share_commitments must name the receivers of the shares, in order")
        if self.next_keys is not None and not isinstance(self.next_keys, KeyOffer):
            raise invalid("next_keys must be a KeyOffer")


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
            raise invalid("every share comes with its dealer's commitments for its receiver")


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
        check_id(self.client_id, "client_id")
        if not isinstance(self.masked, np.ndarray):
            raise invalid("masked must be a numpy array")


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
        check_ids(self.survivors, "survivors")


@dataclasses.dataclass(frozen=True, slots=True)
class ConsistencyReply:
    """Stage consistency, client -> server: its signature of the survivor set."""

    round_id: RoundId
    client_id: str
    signature: bytes

    def __post_init__(self) -> None:
        check_id(self.client_id, "client_id")
        _check_signature(self.signature, "signature")


@dataclasses.dataclass(frozen=True, slots=True)
class Confirmation:
    """A neighbour's signature of the survivor set (from its `ConsistencyReply`)."""

    signer: str
    signature: bytes

    def __post_init__(self) -> None:
        check_id(self.signer, "signer")
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
        check_ids(self.survivors, "survivors")
        signers = [c.signer for c in self.confirmations]
        if len(set(signers)) != len(signers):
            raise invalid("a confirmation is listed twice")


@dataclasses.dataclass(frozen=True, slots=True)
class RevealedShare:
    """One Shamir share (y value) of ``owner``'s secret, as revealed in unmask."""

    owner: str
    value: bytes

    def __post_init__(self) -> None:
        check_id(self.owner, "owner")
        if not isinstance(self.value, bytes) or len(self.value) > 128:
            raise invalid("a share value must be at most 128 bytes")


@dataclasses.dataclass(frozen=True, slots=True)
class UnmaskReply:
    """Stage unmask, client -> server: shares of survivors' self-mask seeds and of
    dropped clients' mask keys."""

    round_id: RoundId
    client_id: str
    self_mask_shares: tuple[RevealedShare, ...]
    mask_key_shares: tuple[RevealedShare, ...]

    def __post_init__(self) -> None:
        check_id(self.client_id, "client_id")


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
