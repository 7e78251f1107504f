"""SecAgg+ identifiers, round parameters and the parts of the stage messages <-> protobuf.

The pieces `_secagg_codec` assembles its tasks and results from: round ids, the round
setup, advertised keys, key offers, sealed and revealed shares, share commitments and
confirmations, with the list bounds of every stage message. Every ``_from_proto``
treats its input as hostile, as in `_secagg_codec`; every refusal is
`MessageRejectedError` (INVALID).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal, Protocol, TypeVar

from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.protos.fedloom.v1.fleet_pb2 import (
    SecAggAdvertisedKeys as ProtoAdvertisedKeys,
)
from fedloom.protos.fedloom.v1.fleet_pb2 import SecAggConfirmation as ProtoConfirmation
from fedloom.protos.fedloom.v1.fleet_pb2 import (
    SecAggEncryptedShare as ProtoEncryptedShare,
)
from fedloom.protos.fedloom.v1.fleet_pb2 import SecAggKeyOffer as ProtoKeyOffer
from fedloom.protos.fedloom.v1.fleet_pb2 import SecAggRevealedShare as ProtoRevealedShare
from fedloom.protos.fedloom.v1.fleet_pb2 import SecAggRoundId as ProtoRoundId
from fedloom.protos.fedloom.v1.fleet_pb2 import SecAggSetup as ProtoSetup
from fedloom.protos.fedloom.v1.fleet_pb2 import (
    SecAggShareCommitment as ProtoShareCommitment,
)
from fedloom.secagg import (
    AdvertisedKeys,
    Confirmation,
    EncryptedShare,
    KeyOffer,
    RevealedShare,
    RoundId,
    RoundSetup,
    ShareCommitment,
)

#: Most participants one round may list (SecAggConfig.max_participants is lower).
MAX_PARTICIPANTS = 1 << 16
#: Most entries in any other list of a stage message (the roster, shares, commitments,
#: survivors, confirmations).
MAX_LIST = MAX_PARTICIPANTS
MAX_INT = (1 << 63) - 1  # fields are packed as signed 64-bit integers

_T = TypeVar("_T")
_P = TypeVar("_P")


class HasRoundId(Protocol):
    """A stage message with a ``round_id`` submessage."""

    @property
    def round_id(self) -> ProtoRoundId: ...

    def HasField(self, field_name: Literal["round_id"]) -> bool: ...


def invalid(message: str) -> MessageRejectedError:
    return MessageRejectedError(RejectReason.INVALID, message)


def bounded(items: Sequence[_P], what: str, convert: Callable[[_P], _T],
             limit: int = MAX_LIST) -> tuple[_T, ...]:
    if len(items) > limit:
        raise invalid(f"{len(items)} {what}; at most {limit} allowed")
    return tuple(convert(item) for item in items)


# ---- identifiers and parameters ------------------------------------------------------
def round_id_to_proto(round_id: RoundId) -> ProtoRoundId:
    return ProtoRoundId(run_id=round_id.run_id, round=round_id.server_round,
                        attempt=round_id.attempt)


def round_id_from_proto(message: ProtoRoundId) -> RoundId:
    if message.round > MAX_INT or message.attempt > MAX_INT:
        raise invalid("a secure-aggregation round or attempt number is out of range")
    return RoundId(message.run_id, int(message.round), int(message.attempt))


def round_id_of(message: HasRoundId, what: str) -> RoundId:
    """The ``round_id`` field of ``message``, which must be set."""
    if not message.HasField("round_id"):
        raise invalid(f"{what} must name its round attempt (round_id is missing)")
    return round_id_from_proto(message.round_id)


def round_setup_to_proto(setup: RoundSetup) -> ProtoSetup:
    return ProtoSetup(
        round_id=round_id_to_proto(setup.round_id),
        participants=list(setup.participants),
        identities=list(setup.identities),
        neighbours=setup.neighbours,
        threshold=setup.threshold,
        clip_range=setup.clip_range,
        bits=setup.bits,
        max_weight=setup.max_weight,
        vector_length=setup.vector_length,
        min_survivors=setup.min_survivors,
        model_digest=setup.model_digest,
        config_digest=setup.config_digest,
        authenticated=setup.authenticated,
    )


def round_setup_from_proto(message: ProtoSetup) -> RoundSetup:
    round_id = round_id_of(message, "a secure-aggregation setup")
    participants = bounded(message.participants, "participants", str, MAX_PARTICIPANTS)
    identities = bounded(message.identities, "identities", str, MAX_PARTICIPANTS)
    if len(identities) != len(participants):
        raise invalid(f"a secure-aggregation setup names {len(identities)} identities for "
                       f"{len(participants)} participants: it must list one identity per "
                       "participant, in participant order")
    for name in ("clip_range", "max_weight"):
        if not math.isfinite(getattr(message, name)):
            raise invalid(f"secure-aggregation {name} is not finite")
    if message.vector_length > MAX_INT:
        raise invalid("secure-aggregation vector_length is out of range")
    return RoundSetup(
        round_id=round_id,
        participants=participants,
        identities=identities,
        neighbours=int(message.neighbours),
        threshold=int(message.threshold),
        clip_range=float(message.clip_range),
        bits=int(message.bits),
        max_weight=float(message.max_weight),
        vector_length=int(message.vector_length),
        min_survivors=int(message.min_survivors),
        model_digest=bytes(message.model_digest),
        config_digest=bytes(message.config_digest),
        authenticated=bool(message.authenticated),
    )


# ---- parts of the stage messages ------------------------------------------------------
def advertised_keys_to_proto(keys: AdvertisedKeys) -> ProtoAdvertisedKeys:
    return ProtoAdvertisedKeys(
        round_id=round_id_to_proto(keys.round_id),
        client_id=keys.client_id,
        cipher_public_key=keys.cipher_public_key,
        mask_public_key=keys.mask_public_key,
        certificate=keys.certificate,
        signature=keys.signature,
    )


def advertised_keys_from_proto(message: ProtoAdvertisedKeys) -> AdvertisedKeys:
    return AdvertisedKeys(
        round_id=round_id_of(message, "advertised keys"),
        client_id=message.client_id,
        cipher_public_key=bytes(message.cipher_public_key),
        mask_public_key=bytes(message.mask_public_key),
        certificate=bytes(message.certificate),
        signature=bytes(message.signature),
    )


def key_offer_to_proto(offer: KeyOffer) -> ProtoKeyOffer:
    return ProtoKeyOffer(cipher_public_key=offer.cipher_public_key,
                         mask_public_key=offer.mask_public_key)


def key_offer_from_proto(message: ProtoKeyOffer) -> KeyOffer:
    return KeyOffer(bytes(message.cipher_public_key), bytes(message.mask_public_key))


def encrypted_share_to_proto(share: EncryptedShare) -> ProtoEncryptedShare:
    return ProtoEncryptedShare(sender=share.sender, receiver=share.receiver, nonce=share.nonce,
                               ciphertext=share.ciphertext)


def encrypted_share_from_proto(message: ProtoEncryptedShare) -> EncryptedShare:
    return EncryptedShare(message.sender, message.receiver, bytes(message.nonce),
                          bytes(message.ciphertext))


def share_commitment_to_proto(commitment: ShareCommitment) -> ProtoShareCommitment:
    return ProtoShareCommitment(holder=commitment.holder, mask_key=commitment.mask_key,
                                self_mask=commitment.self_mask)


def share_commitment_from_proto(message: ProtoShareCommitment) -> ShareCommitment:
    return ShareCommitment(message.holder, bytes(message.mask_key), bytes(message.self_mask))


def confirmation_to_proto(confirmation: Confirmation) -> ProtoConfirmation:
    return ProtoConfirmation(signer=confirmation.signer, signature=confirmation.signature)


def confirmation_from_proto(message: ProtoConfirmation) -> Confirmation:
    return Confirmation(message.signer, bytes(message.signature))


def revealed_share_to_proto(share: RevealedShare) -> ProtoRevealedShare:
    return ProtoRevealedShare(owner=share.owner, value=share.value)


def revealed_share_from_proto(message: ProtoRevealedShare) -> RevealedShare:
    return RevealedShare(message.owner, bytes(message.value))
