"""Hand-built hostile secure-aggregation stage messages on the wire: malformed keys,
commitments, confirmations, oversized lists and payloads are refused with INVALID, never
with another exception."""

from __future__ import annotations

from typing import Any

import pytest
from secagg_wire_support import SESSION, SIGNATURE, masked_info, refused, task_with

from fedloom.messages import MaskedInputHeader, ResultHeader
from fedloom.payload import PayloadInfo
from fedloom.protos import _secagg_codec, codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.secagg import RoundId
from fedloom.secagg._identity import MAX_CERTIFICATE_BYTES, MAX_SIGNATURE_BYTES
from fedloom.types import TaskKind
from fedloom.weights import TensorSpec

ROUND_ID = pb.SecAggRoundId(run_id="run-1", round=1, attempt=0)


def _result_with(kind: str, message: Any) -> pb.ResultHeader:
    """A result header whose oneof ``kind`` is ``message``."""
    header = codec.result_to_proto(ResultHeader(SESSION, "t" * 32, 1, None, failure="x")).result
    getattr(header, kind).CopyFrom(message)
    return header


# ---- hostile keys, commitments and signatures ------------------------------------------
def _keys(**changes: Any) -> pb.SecAggAdvertisedKeys:
    keys = pb.SecAggAdvertisedKeys(round_id=ROUND_ID, client_id="client-000",
                                   cipher_public_key=b"a" * 32, mask_public_key=b"b" * 32)
    for name, value in changes.items():
        setattr(keys, name, value)
    return keys


@pytest.mark.parametrize(("changes", "match"), [
    ({"cipher_public_key": b"short"}, "cipher_public_key must be 32 bytes"),
    ({"mask_public_key": b"a" * 32}, "must differ"),
    ({"client_id": ""}, "client_id"),
    ({"client_id": "x" * 300}, "client_id"),
    ({"certificate": b"c" * (MAX_CERTIFICATE_BYTES + 1), "signature": SIGNATURE},
     "certificate must be at most"),
    ({"certificate": b"der", "signature": b"s" * (MAX_SIGNATURE_BYTES + 1)}, "signature"),
    ({"certificate": b"der"}, "both the certificate and the signature"),
    ({"signature": SIGNATURE}, "both the certificate and the signature"),
])
def test_malformed_keys_are_invalid(changes: dict[str, Any], match: str) -> None:
    refused(codec.result_from_proto, _result_with("secagg_advertised_keys", _keys(**changes)),
            match)


def test_round_numbers_beyond_64_bits_are_invalid() -> None:
    keys = _keys()
    keys.round_id.attempt = (1 << 64) - 1
    refused(codec.result_from_proto, _result_with("secagg_advertised_keys", keys),
            "out of range")


def _commitment(holder: str = "b", length: int = 32) -> pb.SecAggShareCommitment:
    return pb.SecAggShareCommitment(holder=holder, mask_key=b"m" * length,
                                    self_mask=b"s" * 32)


def _share(receiver: str = "b") -> pb.SecAggEncryptedShare:
    return pb.SecAggEncryptedShare(sender="a", receiver=receiver, nonce=b"n" * 12,
                                   ciphertext=b"c")


@pytest.mark.parametrize(("changes", "match"), [
    ({"self_mask_commitment": b"c" * 31}, "self_mask_commitment must be 32 bytes"),
    ({"next_keys": pb.SecAggKeyOffer(cipher_public_key=b"a" * 32, mask_public_key=b"b")},
     "mask_public_key must be 32 bytes"),
    ({"next_keys": pb.SecAggKeyOffer(cipher_public_key=b"a" * 32, mask_public_key=b"a" * 32)},
     "must differ"),
    ({"share_commitments": []}, "share_commitments must name the receivers"),
    ({"share_commitments": [_commitment("c")]}, "share_commitments must name the receivers"),
    ({"share_commitments": [_commitment(length=31)]}, "mask_key commitment must be 32 bytes"),
])
def test_a_malformed_share_keys_result_is_invalid(changes: dict[str, Any], match: str) -> None:
    result = pb.SecAggShareKeysResult(round_id=ROUND_ID, client_id="client-000",
                                      shares=[_share()], self_mask_commitment=b"c" * 32,
                                      share_commitments=[_commitment()])
    for field, value in changes.items():
        if isinstance(value, bytes):
            setattr(result, field, value)
        elif isinstance(value, list):
            del getattr(result, field)[:]
            getattr(result, field).extend(value)
        else:
            getattr(result, field).CopyFrom(value)
    refused(codec.result_from_proto, _result_with("secagg_share_keys", result), match)


@pytest.mark.parametrize(("commitments", "match"), [
    ([], "every share comes with its dealer's commitments"),
    ([_commitment(), _commitment()], "every share comes with its dealer's commitments"),
    ([_commitment("c")], "every share comes with its dealer's commitments"),
    ([_commitment(length=33)], "mask_key commitment must be 32 bytes"),
])
def test_a_masked_input_task_needs_a_commitment_per_share(
        commitments: list[pb.SecAggShareCommitment], match: str) -> None:
    task = pb.SecAggMaskedInputTask(round_id=ROUND_ID, shares=[_share()],
                                    commitments=commitments)
    refused(codec.task_from_proto, task_with("secagg_masked_input", task), match)


def test_a_consistency_result_without_a_signature_is_invalid() -> None:
    result = pb.SecAggConsistencyResult(round_id=ROUND_ID, client_id="client-000")
    refused(codec.result_from_proto, _result_with("secagg_consistency", result), "signature")
    result.signature = b"s" * (MAX_SIGNATURE_BYTES + 1)
    refused(codec.result_from_proto, _result_with("secagg_consistency", result), "signature")


def test_a_consistency_task_lists_sorted_survivors() -> None:
    task = pb.SecAggConsistencyTask(round_id=ROUND_ID, survivors=["b", "a"])
    refused(codec.task_from_proto, task_with("secagg_consistency", task), "sorted")


@pytest.mark.parametrize(("confirmations", "match"), [
    ([pb.SecAggConfirmation(signer="a", signature=SIGNATURE)] * 2, "listed twice"),
    ([pb.SecAggConfirmation(signer="a")], "signature"),
    ([pb.SecAggConfirmation(signature=SIGNATURE)], "signer"),
])
def test_malformed_confirmations_are_invalid(confirmations: list[pb.SecAggConfirmation],
                                             match: str) -> None:
    task = pb.SecAggUnmaskTask(round_id=ROUND_ID, survivors=["a", "b"],
                               confirmations=confirmations)
    refused(codec.task_from_proto, task_with("secagg_unmask", task), match)


# ---- hostile sizes -------------------------------------------------------------------
_TOO_MANY = _secagg_codec.MAX_LIST + 1


@pytest.mark.parametrize("build", [
    lambda: task_with("secagg_masked_input", pb.SecAggMaskedInputTask(
        round_id=ROUND_ID, shares=[_share()] * _TOO_MANY)),
    lambda: task_with("secagg_masked_input", pb.SecAggMaskedInputTask(
        round_id=ROUND_ID, commitments=[_commitment()] * _TOO_MANY)),
    lambda: task_with("secagg_share_keys", pb.SecAggShareKeysTask(
        round_id=ROUND_ID, roster=[_keys()] * _TOO_MANY)),
    lambda: task_with("secagg_consistency", pb.SecAggConsistencyTask(
        round_id=ROUND_ID, survivors=["a"] * _TOO_MANY)),
    lambda: task_with("secagg_unmask", pb.SecAggUnmaskTask(
        round_id=ROUND_ID, confirmations=[pb.SecAggConfirmation()] * _TOO_MANY)),
    lambda: task_with("secagg_advertise_keys", pb.SecAggAdvertiseKeysTask(setup=pb.SecAggSetup(
        round_id=ROUND_ID, participants=["a"] * (_secagg_codec.MAX_PARTICIPANTS + 1)))),
    lambda: task_with("secagg_advertise_keys", pb.SecAggAdvertiseKeysTask(setup=pb.SecAggSetup(
        round_id=ROUND_ID, identities=["a"] * (_secagg_codec.MAX_PARTICIPANTS + 1)))),
], ids=["shares", "commitments", "roster", "survivors", "confirmations", "participants",
        "identities"])
def test_too_many_listed_items_are_invalid(build: Any) -> None:
    refused(codec.task_from_proto, build(), "at most")


def test_too_many_listed_share_commitments_in_a_result_are_invalid() -> None:
    result = pb.SecAggShareKeysResult(round_id=ROUND_ID, client_id="client-000",
                                      self_mask_commitment=b"c" * 32,
                                      share_commitments=[_commitment()] * _TOO_MANY)
    refused(codec.result_from_proto, _result_with("secagg_share_keys", result), "at most")


# ---- payloads ------------------------------------------------------------------------
def test_a_stage_reply_other_than_the_masked_input_carries_no_payload() -> None:
    header = _result_with("secagg_advertised_keys", _keys())
    header.update.CopyFrom(codec.payload_to_proto(masked_info(4)))
    refused(codec.result_from_proto, header, "only a masked input")


@pytest.mark.parametrize(
    "update",
    [
        None,
        PayloadInfo((TensorSpec("masked", "float32", (4,)),), 16, b"\0" * 32),
        PayloadInfo((TensorSpec("weights", "uint32", (4,)),), 16, b"\0" * 32),
        PayloadInfo((TensorSpec("masked", "uint32", (2, 2)),), 16, b"\0" * 32),
        PayloadInfo((TensorSpec("masked", "uint32", (4,)), TensorSpec("x", "uint32", (1,))),
                    20, b"\0" * 32),
    ],
)
def test_a_masked_input_must_be_one_uint32_vector(update: PayloadInfo | None) -> None:
    header = codec.result_to_proto(ResultHeader(
        SESSION, "t" * 32, 1, TaskKind.SECAGG, update=masked_info(4),
        secagg=MaskedInputHeader(RoundId("run-1", 1, 0), "client-000"))).result
    header.ClearField("update")
    if update is not None:
        header.update.CopyFrom(codec.payload_to_proto(update))
    refused(codec.result_from_proto, header)
