"""Secure-aggregation stage messages <-> protobuf (re-exported by `fedloom.protos.codec`).

Part of the one codec, split out to keep modules small: `codec` is still the only
public protobuf touch and calls these from its task and result pairs. Every
``_from_proto`` treats its input as hostile: counts and sizes are bounded here, and the
`fedloom.secagg` dataclasses check ids, key and nonce lengths and the round's
parameters in their constructors; every refusal is `MessageRejectedError` (INVALID).
Whether a message makes sense for the round is the state machines' business.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.messages import MASKED_TENSOR, MaskedInputHeader
from fedloom.payload import PayloadInfo
from fedloom.protos.fedloom.v1.fleet_pb2 import Record as ProtoRecord
from fedloom.protos.fedloom.v1.fleet_pb2 import ResultHeader as ProtoResultHeader
from fedloom.protos.fedloom.v1.fleet_pb2 import (
    SecAggAdvertisedKeys as ProtoAdvertisedKeys,
)
from fedloom.protos.fedloom.v1.fleet_pb2 import (
    SecAggAdvertiseKeysTask as ProtoAdvertiseKeysTask,
)
from fedloom.protos.fedloom.v1.fleet_pb2 import (
    SecAggEncryptedShare as ProtoEncryptedShare,
)
from fedloom.protos.fedloom.v1.fleet_pb2 import SecAggKeyOffer as ProtoKeyOffer
from fedloom.protos.fedloom.v1.fleet_pb2 import (
    SecAggMaskedInputResult as ProtoMaskedInputResult,
)
from fedloom.protos.fedloom.v1.fleet_pb2 import (
    SecAggMaskedInputTask as ProtoMaskedInputTask,
)
from fedloom.protos.fedloom.v1.fleet_pb2 import SecAggRevealedShare as ProtoRevealedShare
from fedloom.protos.fedloom.v1.fleet_pb2 import SecAggRoundId as ProtoRoundId
from fedloom.protos.fedloom.v1.fleet_pb2 import SecAggSetup as ProtoSetup
from fedloom.protos.fedloom.v1.fleet_pb2 import (
    SecAggShareKeysResult as ProtoShareKeysResult,
)
from fedloom.protos.fedloom.v1.fleet_pb2 import SecAggShareKeysTask as ProtoShareKeysTask
from fedloom.protos.fedloom.v1.fleet_pb2 import SecAggUnmaskResult as ProtoUnmaskResult
from fedloom.protos.fedloom.v1.fleet_pb2 import SecAggUnmaskTask as ProtoUnmaskTask
from fedloom.protos.fedloom.v1.fleet_pb2 import TaskHeader as ProtoTaskHeader
from fedloom.secagg import (
    AdvertisedKeys,
    AdvertiseKeysRequest,
    EncryptedShare,
    KeyOffer,
    MaskedInputRequest,
    RevealedShare,
    RoundId,
    RoundSetup,
    SecAggReply,
    SecAggRequest,
    ShareKeysReply,
    ShareKeysRequest,
    UnmaskReply,
    UnmaskRequest,
)

#: Most participants one round may list (SecAggConfig.max_participants is lower).
MAX_PARTICIPANTS = 1 << 16
#: Most entries in one stage message's list (neighbours, shares): a client's k.
MAX_LIST = MAX_PARTICIPANTS
_MAX_INT = (1 << 63) - 1  # fields are packed as signed 64-bit integers

_T = TypeVar("_T")
_P = TypeVar("_P")


def _invalid(message: str) -> MessageRejectedError:
    return MessageRejectedError(RejectReason.INVALID, message)


def _bounded(items: Sequence[_P], what: str, convert: Callable[[_P], _T],
             limit: int = MAX_LIST) -> tuple[_T, ...]:
    if len(items) > limit:
        raise _invalid(f"{len(items)} {what}; at most {limit} allowed")
    return tuple(convert(item) for item in items)


# ---- identifiers and parameters ------------------------------------------------------
def round_id_to_proto(round_id: RoundId) -> ProtoRoundId:
    return ProtoRoundId(run_id=round_id.run_id, round=round_id.server_round,
                        attempt=round_id.attempt)


def round_id_from_proto(message: ProtoRoundId) -> RoundId:
    if message.round > _MAX_INT or message.attempt > _MAX_INT:
        raise _invalid("a secure-aggregation round or attempt number is out of range")
    return RoundId(message.run_id, int(message.round), int(message.attempt))


def round_setup_to_proto(setup: RoundSetup) -> ProtoSetup:
    return ProtoSetup(
        round_id=round_id_to_proto(setup.round_id),
        participants=list(setup.participants),
        neighbours=setup.neighbours,
        threshold=setup.threshold,
        clip_range=setup.clip_range,
        bits=setup.bits,
        max_weight=setup.max_weight,
        vector_length=setup.vector_length,
        graph_seed=setup.graph_seed,
    )


def round_setup_from_proto(message: ProtoSetup) -> RoundSetup:
    if not message.HasField("round_id"):
        raise _invalid("a secure-aggregation setup must name its round attempt")
    participants = _bounded(message.participants, "participants", str, MAX_PARTICIPANTS)
    for name in ("clip_range", "max_weight"):
        if not math.isfinite(getattr(message, name)):
            raise _invalid(f"secure-aggregation {name} is not finite")
    if message.vector_length > _MAX_INT:
        raise _invalid("secure-aggregation vector_length is out of range")
    return RoundSetup(
        round_id=round_id_from_proto(message.round_id),
        participants=participants,
        neighbours=int(message.neighbours),
        threshold=int(message.threshold),
        clip_range=float(message.clip_range),
        bits=int(message.bits),
        max_weight=float(message.max_weight),
        vector_length=int(message.vector_length),
        graph_seed=bytes(message.graph_seed),
    )


# ---- parts of the stage messages ------------------------------------------------------
def advertised_keys_to_proto(keys: AdvertisedKeys) -> ProtoAdvertisedKeys:
    return ProtoAdvertisedKeys(
        round_id=round_id_to_proto(keys.round_id),
        client_id=keys.client_id,
        cipher_public_key=keys.cipher_public_key,
        mask_public_key=keys.mask_public_key,
    )


def advertised_keys_from_proto(message: ProtoAdvertisedKeys) -> AdvertisedKeys:
    return AdvertisedKeys(
        round_id=round_id_from_proto(message.round_id),
        client_id=message.client_id,
        cipher_public_key=bytes(message.cipher_public_key),
        mask_public_key=bytes(message.mask_public_key),
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


def revealed_share_to_proto(share: RevealedShare) -> ProtoRevealedShare:
    return ProtoRevealedShare(owner=share.owner, value=share.value)


def revealed_share_from_proto(message: ProtoRevealedShare) -> RevealedShare:
    return RevealedShare(message.owner, bytes(message.value))


# ---- tasks (server -> client) ---------------------------------------------------------
def share_keys_task_to_proto(request: ShareKeysRequest) -> ProtoShareKeysTask:
    task = ProtoShareKeysTask(round_id=round_id_to_proto(request.round_id),
                              neighbours=[advertised_keys_to_proto(k) for k in request.neighbours])
    if request.setup is not None and request.own_keys is not None:
        task.setup.CopyFrom(round_setup_to_proto(request.setup))
        task.own_keys.CopyFrom(advertised_keys_to_proto(request.own_keys))
    return task


def share_keys_task_from_proto(message: ProtoShareKeysTask) -> ShareKeysRequest:
    setup = round_setup_from_proto(message.setup) if message.HasField("setup") else None
    own = advertised_keys_from_proto(message.own_keys) if message.HasField("own_keys") else None
    return ShareKeysRequest(round_id_from_proto(message.round_id),
                            _bounded(message.neighbours, "neighbour keys",
                                     advertised_keys_from_proto), setup, own)


def masked_input_task_to_proto(request: MaskedInputRequest) -> ProtoMaskedInputTask:
    return ProtoMaskedInputTask(round_id=round_id_to_proto(request.round_id),
                                shares=[encrypted_share_to_proto(s) for s in request.shares])


def masked_input_task_from_proto(message: ProtoMaskedInputTask) -> MaskedInputRequest:
    return MaskedInputRequest(round_id_from_proto(message.round_id),
                              _bounded(message.shares, "shares", encrypted_share_from_proto))


def unmask_task_to_proto(request: UnmaskRequest) -> ProtoUnmaskTask:
    return ProtoUnmaskTask(round_id=round_id_to_proto(request.round_id),
                           survivors=list(request.survivors), dropped=list(request.dropped))


def unmask_task_from_proto(message: ProtoUnmaskTask) -> UnmaskRequest:
    return UnmaskRequest(round_id_from_proto(message.round_id),
                         _bounded(message.survivors, "survivors", str),
                         _bounded(message.dropped, "dropped clients", str))


# ---- results (client -> server) -------------------------------------------------------
def share_keys_result_to_proto(reply: ShareKeysReply) -> ProtoShareKeysResult:
    result = ProtoShareKeysResult(round_id=round_id_to_proto(reply.round_id),
                                  client_id=reply.client_id,
                                  shares=[encrypted_share_to_proto(s) for s in reply.shares],
                                  self_mask_commitment=reply.self_mask_commitment)
    if reply.next_keys is not None:
        result.next_keys.CopyFrom(key_offer_to_proto(reply.next_keys))
    return result


def share_keys_result_from_proto(message: ProtoShareKeysResult) -> ShareKeysReply:
    offer = key_offer_from_proto(message.next_keys) if message.HasField("next_keys") else None
    return ShareKeysReply(round_id_from_proto(message.round_id), message.client_id,
                          _bounded(message.shares, "shares", encrypted_share_from_proto),
                          bytes(message.self_mask_commitment), offer)


def masked_input_result_to_proto(header: MaskedInputHeader) -> ProtoMaskedInputResult:
    return ProtoMaskedInputResult(round_id=round_id_to_proto(header.round_id),
                                  client_id=header.client_id)


def masked_input_result_from_proto(message: ProtoMaskedInputResult) -> MaskedInputHeader:
    if not 0 < len(message.client_id) <= 256:
        raise _invalid("a masked input must name its client (1..256 characters)")
    return MaskedInputHeader(round_id_from_proto(message.round_id), message.client_id)


def unmask_result_to_proto(reply: UnmaskReply) -> ProtoUnmaskResult:
    return ProtoUnmaskResult(
        round_id=round_id_to_proto(reply.round_id),
        client_id=reply.client_id,
        self_mask_shares=[revealed_share_to_proto(s) for s in reply.self_mask_shares],
        mask_key_shares=[revealed_share_to_proto(s) for s in reply.mask_key_shares],
    )


def unmask_result_from_proto(message: ProtoUnmaskResult) -> UnmaskReply:
    return UnmaskReply(
        round_id_from_proto(message.round_id),
        message.client_id,
        _bounded(message.self_mask_shares, "self-mask shares", revealed_share_from_proto),
        _bounded(message.mask_key_shares, "mask-key shares", revealed_share_from_proto),
    )


# ---- the stage kinds inside TaskHeader and ResultHeader ---------------------------------
def secagg_task_to_proto(request: SecAggRequest | None, config: ProtoRecord,
                         header: ProtoTaskHeader) -> None:
    """Set the stage of ``request`` in ``header``'s kind (``config``, the fit config, goes
    with stage 3, where the client trains)."""
    if isinstance(request, AdvertiseKeysRequest):
        header.secagg_advertise_keys.CopyFrom(
            ProtoAdvertiseKeysTask(setup=round_setup_to_proto(request.setup)))
    elif isinstance(request, ShareKeysRequest):
        header.secagg_share_keys.CopyFrom(share_keys_task_to_proto(request))
    elif isinstance(request, MaskedInputRequest):
        task = masked_input_task_to_proto(request)
        task.config.CopyFrom(config)
        header.secagg_masked_input.CopyFrom(task)
    elif isinstance(request, UnmaskRequest):
        header.secagg_unmask.CopyFrom(unmask_task_to_proto(request))
    else:
        raise TypeError(f"a secagg task needs a stage request, got {type(request).__name__}")


def secagg_task_from_proto(header: ProtoTaskHeader, kind: str
                           ) -> tuple[SecAggRequest, ProtoRecord | None]:
    """The stage request in ``header`` (of oneof ``kind``) and, for stage 3, its config."""
    if kind == "secagg_advertise_keys":
        task = header.secagg_advertise_keys
        if not task.HasField("setup"):
            raise _invalid("an advertise-keys task must carry the round's setup")
        return AdvertiseKeysRequest(round_setup_from_proto(task.setup)), None
    if kind == "secagg_share_keys":
        return share_keys_task_from_proto(header.secagg_share_keys), None
    if kind == "secagg_masked_input":
        masked = header.secagg_masked_input
        return masked_input_task_from_proto(masked), masked.config
    if kind == "secagg_unmask":
        return unmask_task_from_proto(header.secagg_unmask), None
    raise _invalid(f"task kind {kind!r} is not supported by this client")


def secagg_result_to_proto(reply: SecAggReply | MaskedInputHeader | None,
                           header: ProtoResultHeader) -> None:
    if isinstance(reply, AdvertisedKeys):
        header.secagg_advertised_keys.CopyFrom(advertised_keys_to_proto(reply))
    elif isinstance(reply, ShareKeysReply):
        header.secagg_share_keys.CopyFrom(share_keys_result_to_proto(reply))
    elif isinstance(reply, MaskedInputHeader):
        header.secagg_masked_input.CopyFrom(masked_input_result_to_proto(reply))
    elif isinstance(reply, UnmaskReply):
        header.secagg_unmask.CopyFrom(unmask_result_to_proto(reply))
    else:
        raise TypeError(f"a secagg result needs a stage reply, got {type(reply).__name__}")


def check_masked_payload(update: PayloadInfo | None) -> PayloadInfo:
    """A masked input's payload: exactly one 1-D uint32 tensor named ``masked``."""
    if update is None or len(update.specs) != 1:
        raise _invalid(f"a masked input carries exactly one tensor {MASKED_TENSOR!r}")
    spec = update.specs[0]
    if spec.name != MASKED_TENSOR or spec.dtype != "uint32" or len(spec.shape) != 1:
        raise _invalid(f"a masked input is one 1-D uint32 tensor {MASKED_TENSOR!r}, got "
                       f"{spec.name[:64]!r} {spec.dtype}{list(spec.shape)}")
    return update


def secagg_result_from_proto(header: ProtoResultHeader, kind: str, update: PayloadInfo | None
                             ) -> AdvertisedKeys | ShareKeysReply | MaskedInputHeader | UnmaskReply:
    """The stage reply in ``header`` (of oneof ``kind``); only a masked input has a payload."""
    if kind == "secagg_masked_input":
        check_masked_payload(update)
        return masked_input_result_from_proto(header.secagg_masked_input)
    if update is not None:
        raise _invalid("only a masked input carries a payload among the secagg stages")
    if kind == "secagg_advertised_keys":
        return advertised_keys_from_proto(header.secagg_advertised_keys)
    if kind == "secagg_share_keys":
        return share_keys_result_from_proto(header.secagg_share_keys)
    if kind == "secagg_unmask":
        return unmask_result_from_proto(header.secagg_unmask)
    raise _invalid(f"result kind {kind!r} is not a secure-aggregation stage")
