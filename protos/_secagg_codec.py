"""Secure-aggregation stage messages <-> protobuf (re-exported by `fedloom.protos.codec`).

Part of the one codec: `codec` is still the only public protobuf touch and calls these
from its task and result pairs; the parts of the messages (round ids, the setup, keys,
shares, commitments, confirmations) are converted by `_secagg_parts`. Every
``_from_proto`` treats its input as hostile: list lengths, numeric ranges, a missing
``round_id`` and a setup's identities-per-participant are checked here, and the
`fedloom.secagg` dataclasses check ids, the lengths of keys, nonces, digests,
commitments, certificates and signatures, and the round's parameters in their
constructors; every refusal is `MessageRejectedError` (INVALID).
Whether a message makes sense for the round is the state machines' business.
"""

from __future__ import annotations

from fedloom.messages import MASKED_TENSOR, MaskedInputHeader
from fedloom.payload import PayloadInfo
from fedloom.protos._secagg_parts import (
    MAX_LIST,
    MAX_PARTICIPANTS,
    advertised_keys_from_proto,
    advertised_keys_to_proto,
    bounded,
    confirmation_from_proto,
    confirmation_to_proto,
    encrypted_share_from_proto,
    encrypted_share_to_proto,
    invalid,
    key_offer_from_proto,
    key_offer_to_proto,
    revealed_share_from_proto,
    revealed_share_to_proto,
    round_id_from_proto,
    round_id_of,
    round_id_to_proto,
    round_setup_from_proto,
    round_setup_to_proto,
    share_commitment_from_proto,
    share_commitment_to_proto,
)
from fedloom.protos.fedloom.v1.fleet_pb2 import Record as ProtoRecord
from fedloom.protos.fedloom.v1.fleet_pb2 import ResultHeader as ProtoResultHeader
from fedloom.protos.fedloom.v1.fleet_pb2 import (
    SecAggAdvertisedKeys as ProtoAdvertisedKeys,
)
from fedloom.protos.fedloom.v1.fleet_pb2 import (
    SecAggAdvertiseKeysTask as ProtoAdvertiseKeysTask,
)
from fedloom.protos.fedloom.v1.fleet_pb2 import (
    SecAggConsistencyResult as ProtoConsistencyResult,
)
from fedloom.protos.fedloom.v1.fleet_pb2 import (
    SecAggConsistencyTask as ProtoConsistencyTask,
)
from fedloom.protos.fedloom.v1.fleet_pb2 import (
    SecAggMaskedInputResult as ProtoMaskedInputResult,
)
from fedloom.protos.fedloom.v1.fleet_pb2 import (
    SecAggMaskedInputTask as ProtoMaskedInputTask,
)
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
    ConsistencyReply,
    ConsistencyRequest,
    MaskedInputRequest,
    SecAggReply,
    SecAggRequest,
    ShareKeysReply,
    ShareKeysRequest,
    UnmaskReply,
    UnmaskRequest,
)

#: The stage messages and, re-exported, their parts (`_secagg_parts`).
__all__ = [
    "MAX_LIST",
    "MAX_PARTICIPANTS",
    "advertised_keys_from_proto",
    "advertised_keys_to_proto",
    "check_masked_payload",
    "confirmation_from_proto",
    "confirmation_to_proto",
    "consistency_result_from_proto",
    "consistency_result_to_proto",
    "consistency_task_from_proto",
    "consistency_task_to_proto",
    "encrypted_share_from_proto",
    "encrypted_share_to_proto",
    "key_offer_from_proto",
    "key_offer_to_proto",
    "masked_input_result_from_proto",
    "masked_input_result_to_proto",
    "masked_input_task_from_proto",
    "masked_input_task_to_proto",
    "revealed_share_from_proto",
    "revealed_share_to_proto",
    "round_id_from_proto",
    "round_id_to_proto",
    "round_setup_from_proto",
    "round_setup_to_proto",
    "secagg_result_from_proto",
    "secagg_result_to_proto",
    "secagg_task_from_proto",
    "secagg_task_to_proto",
    "share_commitment_from_proto",
    "share_commitment_to_proto",
    "share_keys_result_from_proto",
    "share_keys_result_to_proto",
    "share_keys_task_from_proto",
    "share_keys_task_to_proto",
    "unmask_result_from_proto",
    "unmask_result_to_proto",
    "unmask_task_from_proto",
    "unmask_task_to_proto",
]


# ---- tasks (server -> client) ---------------------------------------------------------
#: The last roster encoded, and its messages: every client of an attempt is sent the same
#: roster (the state machine hands out one tuple), so it is encoded once, not once per
#: client (20 x 20 keys with certificates, each round, on the server's event loop).
_last_roster: tuple[tuple[AdvertisedKeys, ...], list[ProtoAdvertisedKeys]] = ((), [])


def _roster_to_proto(roster: tuple[AdvertisedKeys, ...]) -> list[ProtoAdvertisedKeys]:
    global _last_roster
    cached = _last_roster  # one read: another thread may replace it meanwhile
    if cached[0] is not roster:
        cached = _last_roster = (roster, [advertised_keys_to_proto(k) for k in roster])
    return cached[1]


def share_keys_task_to_proto(request: ShareKeysRequest) -> ProtoShareKeysTask:
    task = ProtoShareKeysTask(round_id=round_id_to_proto(request.round_id),
                              roster=_roster_to_proto(request.roster))
    if request.setup is not None and request.own_keys is not None:
        task.setup.CopyFrom(round_setup_to_proto(request.setup))
        task.own_keys.CopyFrom(advertised_keys_to_proto(request.own_keys))
    return task


def share_keys_task_from_proto(message: ProtoShareKeysTask) -> ShareKeysRequest:
    setup = round_setup_from_proto(message.setup) if message.HasField("setup") else None
    own = advertised_keys_from_proto(message.own_keys) if message.HasField("own_keys") else None
    return ShareKeysRequest(round_id_of(message, "a share-keys task"),
                            bounded(message.roster, "roster keys", advertised_keys_from_proto),
                            setup, own)


def masked_input_task_to_proto(request: MaskedInputRequest) -> ProtoMaskedInputTask:
    return ProtoMaskedInputTask(
        round_id=round_id_to_proto(request.round_id),
        shares=[encrypted_share_to_proto(s) for s in request.shares],
        commitments=[share_commitment_to_proto(c) for c in request.commitments],
    )


def masked_input_task_from_proto(message: ProtoMaskedInputTask) -> MaskedInputRequest:
    return MaskedInputRequest(
        round_id_of(message, "a masked-input task"),
        bounded(message.shares, "shares", encrypted_share_from_proto),
        bounded(message.commitments, "share commitments", share_commitment_from_proto),
    )


def consistency_task_to_proto(request: ConsistencyRequest) -> ProtoConsistencyTask:
    return ProtoConsistencyTask(round_id=round_id_to_proto(request.round_id),
                                survivors=list(request.survivors))


def consistency_task_from_proto(message: ProtoConsistencyTask) -> ConsistencyRequest:
    return ConsistencyRequest(round_id_of(message, "a consistency task"),
                              bounded(message.survivors, "survivors", str))


def unmask_task_to_proto(request: UnmaskRequest) -> ProtoUnmaskTask:
    return ProtoUnmaskTask(
        round_id=round_id_to_proto(request.round_id),
        survivors=list(request.survivors),
        confirmations=[confirmation_to_proto(c) for c in request.confirmations],
    )


def unmask_task_from_proto(message: ProtoUnmaskTask) -> UnmaskRequest:
    return UnmaskRequest(
        round_id_of(message, "an unmask task"),
        bounded(message.survivors, "survivors", str),
        bounded(message.confirmations, "confirmations", confirmation_from_proto),
    )


# ---- results (client -> server) -------------------------------------------------------
def share_keys_result_to_proto(reply: ShareKeysReply) -> ProtoShareKeysResult:
    result = ProtoShareKeysResult(round_id=round_id_to_proto(reply.round_id),
                                  client_id=reply.client_id,
                                  shares=[encrypted_share_to_proto(s) for s in reply.shares],
                                  self_mask_commitment=reply.self_mask_commitment,
                                  share_commitments=[share_commitment_to_proto(c)
                                                     for c in reply.share_commitments])
    if reply.next_keys is not None:
        result.next_keys.CopyFrom(key_offer_to_proto(reply.next_keys))
    return result


def share_keys_result_from_proto(message: ProtoShareKeysResult) -> ShareKeysReply:
    offer = key_offer_from_proto(message.next_keys) if message.HasField("next_keys") else None
    return ShareKeysReply(
        round_id_of(message, "a share-keys result"),
        message.client_id,
        bounded(message.shares, "shares", encrypted_share_from_proto),
        bytes(message.self_mask_commitment),
        bounded(message.share_commitments, "share commitments", share_commitment_from_proto),
        offer,
    )


def masked_input_result_to_proto(header: MaskedInputHeader) -> ProtoMaskedInputResult:
    return ProtoMaskedInputResult(round_id=round_id_to_proto(header.round_id),
                                  client_id=header.client_id)


def masked_input_result_from_proto(message: ProtoMaskedInputResult) -> MaskedInputHeader:
    if not 0 < len(message.client_id) <= 256:
        raise invalid("a masked input must name its client (1..256 characters)")
    return MaskedInputHeader(round_id_of(message, "a masked-input result"), message.client_id)


def consistency_result_to_proto(reply: ConsistencyReply) -> ProtoConsistencyResult:
    return ProtoConsistencyResult(round_id=round_id_to_proto(reply.round_id),
                                  client_id=reply.client_id, signature=reply.signature)


def consistency_result_from_proto(message: ProtoConsistencyResult) -> ConsistencyReply:
    return ConsistencyReply(round_id_of(message, "a consistency result"), message.client_id,
                            bytes(message.signature))


def unmask_result_to_proto(reply: UnmaskReply) -> ProtoUnmaskResult:
    return ProtoUnmaskResult(
        round_id=round_id_to_proto(reply.round_id),
        client_id=reply.client_id,
        self_mask_shares=[revealed_share_to_proto(s) for s in reply.self_mask_shares],
        mask_key_shares=[revealed_share_to_proto(s) for s in reply.mask_key_shares],
    )


def unmask_result_from_proto(message: ProtoUnmaskResult) -> UnmaskReply:
    return UnmaskReply(
        round_id_of(message, "an unmask result"),
        message.client_id,
        bounded(message.self_mask_shares, "self-mask shares", revealed_share_from_proto),
        bounded(message.mask_key_shares, "mask-key shares", revealed_share_from_proto),
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
    elif isinstance(request, ConsistencyRequest):
        header.secagg_consistency.CopyFrom(consistency_task_to_proto(request))
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
            raise invalid("an advertise-keys task must carry the round's setup")
        return AdvertiseKeysRequest(round_setup_from_proto(task.setup)), None
    if kind == "secagg_share_keys":
        return share_keys_task_from_proto(header.secagg_share_keys), None
    if kind == "secagg_masked_input":
        masked = header.secagg_masked_input
        return masked_input_task_from_proto(masked), masked.config
    if kind == "secagg_consistency":
        return consistency_task_from_proto(header.secagg_consistency), None
    if kind == "secagg_unmask":
        return unmask_task_from_proto(header.secagg_unmask), None
    raise invalid(f"task kind {kind!r} is not supported by this client")


def secagg_result_to_proto(reply: SecAggReply | MaskedInputHeader | None,
                           header: ProtoResultHeader) -> None:
    if isinstance(reply, AdvertisedKeys):
        header.secagg_advertised_keys.CopyFrom(advertised_keys_to_proto(reply))
    elif isinstance(reply, ShareKeysReply):
        header.secagg_share_keys.CopyFrom(share_keys_result_to_proto(reply))
    elif isinstance(reply, MaskedInputHeader):
        header.secagg_masked_input.CopyFrom(masked_input_result_to_proto(reply))
    elif isinstance(reply, ConsistencyReply):
        header.secagg_consistency.CopyFrom(consistency_result_to_proto(reply))
    elif isinstance(reply, UnmaskReply):
        header.secagg_unmask.CopyFrom(unmask_result_to_proto(reply))
    else:
        raise TypeError(f"a secagg result needs a stage reply, got {type(reply).__name__}")


def check_masked_payload(update: PayloadInfo | None) -> PayloadInfo:
    """A masked input's payload: exactly one 1-D uint32 tensor named ``masked``."""
    if update is None or len(update.specs) != 1:
        raise invalid(f"a masked input carries exactly one tensor {MASKED_TENSOR!r}")
    spec = update.specs[0]
    if spec.name != MASKED_TENSOR or spec.dtype != "uint32" or len(spec.shape) != 1:
        raise invalid(f"a masked input is one 1-D uint32 tensor {MASKED_TENSOR!r}, got "
                       f"{spec.name[:64]!r} {spec.dtype}{list(spec.shape)}")
    return update


def secagg_result_from_proto(header: ProtoResultHeader, kind: str, update: PayloadInfo | None
                             ) -> SecAggReply | MaskedInputHeader:
    """The stage reply in ``header`` (of oneof ``kind``); only a masked input has a payload."""
    if kind == "secagg_masked_input":
        check_masked_payload(update)
        return masked_input_result_from_proto(header.secagg_masked_input)
    if update is not None:
        raise invalid("only a masked input carries a payload among the secagg stages")
    if kind == "secagg_advertised_keys":
        return advertised_keys_from_proto(header.secagg_advertised_keys)
    if kind == "secagg_share_keys":
        return share_keys_result_from_proto(header.secagg_share_keys)
    if kind == "secagg_consistency":
        return consistency_result_from_proto(header.secagg_consistency)
    if kind == "secagg_unmask":
        return unmask_result_from_proto(header.secagg_unmask)
    raise invalid(f"result kind {kind!r} is not a secure-aggregation stage")
