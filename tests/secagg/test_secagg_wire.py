"""The secure-aggregation stages on the wire: codec round trips and hostile headers.

Every request and reply of real in-process rounds (the state machines' own messages)
goes through `codec` to protobuf bytes and back and must come out equal: an
authenticated round (all five stages, signed keys, confirmations), an unauthenticated
one (no consistency stage, key offers) and the next unauthenticated attempt, which runs
on those offers. Malformed stage messages are refused with INVALID, never with another
exception.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from secagg_driver import ids_of, make_inputs, run, setup_round

from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.messages import (
    MASKED_TENSOR,
    MaskedInputHeader,
    ResultHeader,
    Session,
    TaskHeader,
)
from fedloom.payload import PayloadInfo
from fedloom.protos import _secagg_codec, codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.secagg import (
    AdvertisedKeys,
    AdvertiseKeysRequest,
    MaskedInputReply,
    RoundId,
    RoundSetup,
    SecAggConfig,
    SecAggStatus,
    ShareKeysReply,
    ShareKeysRequest,
    Stage,
)
from fedloom.secagg._identity import MAX_CERTIFICATE_BYTES, MAX_SIGNATURE_BYTES
from fedloom.types import TaskKind
from fedloom.weights import TensorSpec

Transcript = list[tuple[Stage, str, Any, Any]]

SESSION = Session("client-000", b"s" * 32)
EMPTY = PayloadInfo((), 0, hashlib.sha256(b"").digest())
CONFIG = SecAggConfig(neighbours=4, threshold=3, max_participants=16, bits=20)
#: The stages each recorded round runs.
STAGES = {
    "authenticated": set(Stage),
    "unauthenticated": set(Stage) - {Stage.CONSISTENCY},
    "on_offers": {Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASK},
}
ROUND_ID = pb.SecAggRoundId(run_id="run-1", round=1, attempt=0)
SIGNATURE = b"\x30" * 70


@pytest.fixture(scope="module")
def rounds() -> dict[str, Transcript]:
    """The transcripts of three real rounds, by the names of `STAGES`."""
    inputs = make_inputs(ids_of(7), 9, seed=3)
    drop = {"client-006": Stage.MASKED_INPUT}  # so unmask has a neighbour that dropped
    signed = run(setup_round(CONFIG, inputs, RoundId("run-1", 1, 5)), drop_at=drop)
    plain = run(setup_round(CONFIG, inputs, RoundId("run-1", 1, 6), authenticated=False),
                drop_at=drop)
    offers = {cid: reply.next_keys for _, cid, _, reply in plain.transcript
              if isinstance(reply, ShareKeysReply) and reply.next_keys is not None}
    # the next round (a client that revealed shares in round 1 joins no other attempt of it)
    on_offers = run(setup_round(CONFIG, inputs, RoundId("run-1", 2, 7), clients=plain.clients,
                                offers=offers, authenticated=False))
    for rnd in (signed, plain, on_offers):
        assert rnd.server.status is SecAggStatus.SUCCEEDED, (rnd.refusals, rnd.rejections)
    return {"authenticated": signed.transcript, "unauthenticated": plain.transcript,
            "on_offers": on_offers.transcript}


def _task(request: Any, config: dict[str, Any] | None = None) -> TaskHeader:
    return TaskHeader("t" * 32, "run-1", 1, TaskKind.SECAGG, config or {}, 30.0, EMPTY,
                      secagg=request)


def _through_wire_task(task: TaskHeader) -> TaskHeader:
    wire = codec.task_to_proto(task).SerializeToString()
    return codec.task_from_proto(pb.PullResponse.FromString(wire).task)


def _through_wire_result(result: ResultHeader) -> ResultHeader:
    wire = codec.result_to_proto(result).SerializeToString()
    return codec.result_from_proto(pb.PushRequest.FromString(wire).result)


def _masked_info(length: int) -> PayloadInfo:
    spec = TensorSpec(MASKED_TENSOR, "uint32", (length,))
    return PayloadInfo((spec,), spec.nbytes, b"\0" * 32)


def _result_proto(reply: Any) -> pb.ResultHeader:
    """``reply`` as a result header (a masked input as its header and payload info)."""
    if isinstance(reply, MaskedInputReply):
        return codec.result_to_proto(ResultHeader(
            SESSION, "t" * 32, 1, TaskKind.SECAGG, update=_masked_info(len(reply.masked)),
            secagg=MaskedInputHeader(reply.round_id, reply.client_id))).result
    return codec.result_to_proto(ResultHeader(SESSION, "t" * 32, 1, TaskKind.SECAGG,
                                              secagg=reply)).result


def _task_with(kind: str, message: Any) -> pb.TaskHeader:
    """A task header whose oneof ``kind`` is ``message``."""
    header = pb.TaskHeader(task_id="t", run_id="r", round=1, weights=codec.payload_to_proto(EMPTY))
    getattr(header, kind).CopyFrom(message)
    return header


def _result_with(kind: str, message: Any) -> pb.ResultHeader:
    """A result header whose oneof ``kind`` is ``message``."""
    header = codec.result_to_proto(ResultHeader(SESSION, "t" * 32, 1, None, failure="x")).result
    getattr(header, kind).CopyFrom(message)
    return header


def _refused(parse: Any, header: Any, match: str | None = None) -> MessageRejectedError:
    with pytest.raises(MessageRejectedError, match=match) as info:
        parse(header)
    assert info.value.reason is RejectReason.INVALID
    return info.value


def _setup_of(rounds: dict[str, Transcript]) -> RoundSetup:
    request = next(r for s, _, r, _ in rounds["authenticated"] if s is Stage.ADVERTISE_KEYS)
    assert isinstance(request, AdvertiseKeysRequest)
    return request.setup


# ---- real rounds round-trip ----------------------------------------------------------
@pytest.mark.parametrize("name", list(STAGES))
def test_every_request_of_a_real_round_round_trips(rounds: dict[str, Transcript],
                                                   name: str) -> None:
    stages = set()
    for stage, _cid, request, _reply in rounds[name]:
        config = {"server_round": 1, "lr": 0.1} if stage is Stage.MASKED_INPUT else {}
        back = _through_wire_task(_task(request, config))
        assert back.kind is TaskKind.SECAGG
        assert back.secagg == request
        assert dict(back.config) == config
        stages.add(stage)
    assert stages == STAGES[name]


@pytest.mark.parametrize("name", list(STAGES))
def test_every_reply_of_a_real_round_round_trips(rounds: dict[str, Transcript],
                                                 name: str) -> None:
    for _stage, _cid, _request, reply in rounds[name]:
        wire = _result_proto(reply).SerializeToString()
        back = codec.result_from_proto(pb.ResultHeader.FromString(wire))
        assert back.kind is TaskKind.SECAGG and back.session == SESSION
        if isinstance(reply, MaskedInputReply):
            assert back.secagg == MaskedInputHeader(reply.round_id, reply.client_id)
            assert back.update == _masked_info(len(reply.masked))
        else:
            assert back.secagg == reply
            assert back.update is None


@pytest.mark.parametrize("name", list(STAGES))
def test_the_setup_keeps_its_digest_through_the_wire(rounds: dict[str, Transcript],
                                                     name: str) -> None:
    setups = [r.setup for _, _, r, _ in rounds[name]
              if isinstance(r, AdvertiseKeysRequest | ShareKeysRequest) and r.setup is not None]
    assert setups
    for setup in setups:
        back = _secagg_codec.round_setup_from_proto(pb.SecAggSetup.FromString(
            _secagg_codec.round_setup_to_proto(setup).SerializeToString()))
        assert back == setup and back.digest == setup.digest
        assert back.authenticated is (name == "authenticated")


def test_authenticated_keys_travel_signed_and_offers_only_unauthenticated(
        rounds: dict[str, Transcript]) -> None:
    signed = [r for s, _, _, r in rounds["authenticated"] if s is Stage.ADVERTISE_KEYS]
    assert signed and all(isinstance(k, AdvertisedKeys) and k.signed for k in signed)
    for keys in signed:
        back = _secagg_codec.advertised_keys_from_proto(
            _secagg_codec.advertised_keys_to_proto(keys))
        assert (back.certificate, back.signature) == (keys.certificate, keys.signature)
    for name, offered in (("authenticated", False), ("unauthenticated", True)):
        replies = [r for s, _, _, r in rounds[name] if s is Stage.SHARE_KEYS]
        assert replies and all(isinstance(r, ShareKeysReply) and r.share_commitments
                               for r in replies)
        assert all((r.next_keys is not None) is offered for r in replies), name


def test_a_share_keys_task_on_offered_keys_carries_the_setup(
        rounds: dict[str, Transcript]) -> None:
    requests = [r for s, _, r, _ in rounds["on_offers"] if s is Stage.SHARE_KEYS]
    assert requests
    for request in requests:
        assert request.setup is not None and request.own_keys is not None
        back = _through_wire_task(_task(request)).secagg
        assert isinstance(back, ShareKeysRequest) and back.setup is not None
        assert back == request and back.setup.digest == request.setup.digest


def test_an_advertised_key_message_equals_its_domain_form() -> None:
    keys = AdvertisedKeys(RoundId("run-1", 2, 7), "client-001", b"\1" * 32, b"\2" * 32,
                          certificate=b"der", signature=SIGNATURE)
    assert _secagg_codec.advertised_keys_from_proto(
        _secagg_codec.advertised_keys_to_proto(keys)) == keys
    assert np.array_equal(np.frombuffer(keys.mask_public_key, np.uint8), np.full(32, 2))


# ---- hostile setups ------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value"), [
    ("threshold", 1), ("bits", 40), ("clip_range", float("nan")),
    ("model_digest", b"short"), ("config_digest", b""),
    ("min_survivors", 0), ("min_survivors", 99),
])
def test_a_setup_with_bad_parameters_is_invalid(rounds: dict[str, Transcript], field: str,
                                                value: Any) -> None:
    setup = _secagg_codec.round_setup_to_proto(_setup_of(rounds))
    setattr(setup, field, value)
    _refused(codec.task_from_proto,
             _task_with("secagg_advertise_keys", pb.SecAggAdvertiseKeysTask(setup=setup)))


def test_a_setup_must_name_one_identity_per_participant(rounds: dict[str, Transcript]) -> None:
    setup = _secagg_codec.round_setup_to_proto(_setup_of(rounds))
    del setup.identities[-1]
    _refused(_secagg_codec.round_setup_from_proto, setup, "one identity per participant")


def test_an_authenticated_setup_seats_every_identity_once(
        rounds: dict[str, Transcript]) -> None:
    setup = _secagg_codec.round_setup_to_proto(_setup_of(rounds))
    setup.identities[1] = setup.identities[0]
    _refused(_secagg_codec.round_setup_from_proto, setup, "every identity once")


def test_an_unsorted_or_missing_setup_is_invalid(rounds: dict[str, Transcript]) -> None:
    setup = _secagg_codec.round_setup_to_proto(_setup_of(rounds))
    unsorted = pb.SecAggSetup()
    unsorted.CopyFrom(setup)
    unsorted.participants[0], unsorted.participants[1] = setup.participants[1], \
        setup.participants[0]
    _refused(_secagg_codec.round_setup_from_proto, unsorted, "sorted")
    _refused(codec.task_from_proto,
             _task_with("secagg_advertise_keys", pb.SecAggAdvertiseKeysTask()), "setup")


def test_a_share_keys_task_with_a_setup_but_no_own_keys_is_invalid(
        rounds: dict[str, Transcript]) -> None:
    setup = _setup_of(rounds)
    header = codec.task_to_proto(_task(ShareKeysRequest(setup.round_id, ()))).task
    header.secagg_share_keys.setup.CopyFrom(_secagg_codec.round_setup_to_proto(setup))
    _refused(codec.task_from_proto, header, "both the setup and the client's own keys")


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
    _refused(codec.result_from_proto, _result_with("secagg_advertised_keys", _keys(**changes)),
             match)


def test_round_numbers_beyond_64_bits_are_invalid() -> None:
    keys = _keys()
    keys.round_id.attempt = (1 << 64) - 1
    _refused(codec.result_from_proto, _result_with("secagg_advertised_keys", keys),
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
    _refused(codec.result_from_proto, _result_with("secagg_share_keys", result), match)


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
    _refused(codec.task_from_proto, _task_with("secagg_masked_input", task), match)


def test_a_consistency_result_without_a_signature_is_invalid() -> None:
    result = pb.SecAggConsistencyResult(round_id=ROUND_ID, client_id="client-000")
    _refused(codec.result_from_proto, _result_with("secagg_consistency", result), "signature")
    result.signature = b"s" * (MAX_SIGNATURE_BYTES + 1)
    _refused(codec.result_from_proto, _result_with("secagg_consistency", result), "signature")


def test_a_consistency_task_lists_sorted_survivors() -> None:
    task = pb.SecAggConsistencyTask(round_id=ROUND_ID, survivors=["b", "a"])
    _refused(codec.task_from_proto, _task_with("secagg_consistency", task), "sorted")


@pytest.mark.parametrize(("confirmations", "match"), [
    ([pb.SecAggConfirmation(signer="a", signature=SIGNATURE)] * 2, "listed twice"),
    ([pb.SecAggConfirmation(signer="a")], "signature"),
    ([pb.SecAggConfirmation(signature=SIGNATURE)], "signer"),
])
def test_malformed_confirmations_are_invalid(confirmations: list[pb.SecAggConfirmation],
                                             match: str) -> None:
    task = pb.SecAggUnmaskTask(round_id=ROUND_ID, survivors=["a", "b"],
                               confirmations=confirmations)
    _refused(codec.task_from_proto, _task_with("secagg_unmask", task), match)


def test_every_stage_message_must_name_its_round(rounds: dict[str, Transcript]) -> None:
    """A task or result whose round_id submessage is missing is refused, stage by stage."""
    tasks, results = set(), set()
    for stage, _cid, request, reply in rounds["authenticated"]:
        task = codec.task_to_proto(_task(request)).task
        task_kind = task.WhichOneof("kind")
        assert task_kind is not None
        inner = getattr(task, task_kind)
        (inner.setup if stage is Stage.ADVERTISE_KEYS else inner).ClearField("round_id")
        _refused(codec.task_from_proto, task, "round_id is missing")
        result = _result_proto(reply)
        result_kind = result.WhichOneof("kind")
        assert result_kind is not None
        getattr(result, result_kind).ClearField("round_id")
        _refused(codec.result_from_proto, result, "round_id is missing")
        tasks.add(task_kind)
        results.add(result_kind)
    assert len(tasks) == len(results) == len(Stage)


# ---- hostile sizes -------------------------------------------------------------------
_TOO_MANY = _secagg_codec.MAX_LIST + 1


@pytest.mark.parametrize("build", [
    lambda: _task_with("secagg_masked_input", pb.SecAggMaskedInputTask(
        round_id=ROUND_ID, shares=[_share()] * _TOO_MANY)),
    lambda: _task_with("secagg_masked_input", pb.SecAggMaskedInputTask(
        round_id=ROUND_ID, commitments=[_commitment()] * _TOO_MANY)),
    lambda: _task_with("secagg_share_keys", pb.SecAggShareKeysTask(
        round_id=ROUND_ID, roster=[_keys()] * _TOO_MANY)),
    lambda: _task_with("secagg_consistency", pb.SecAggConsistencyTask(
        round_id=ROUND_ID, survivors=["a"] * _TOO_MANY)),
    lambda: _task_with("secagg_unmask", pb.SecAggUnmaskTask(
        round_id=ROUND_ID, confirmations=[pb.SecAggConfirmation()] * _TOO_MANY)),
    lambda: _task_with("secagg_advertise_keys", pb.SecAggAdvertiseKeysTask(setup=pb.SecAggSetup(
        round_id=ROUND_ID, participants=["a"] * (_secagg_codec.MAX_PARTICIPANTS + 1)))),
    lambda: _task_with("secagg_advertise_keys", pb.SecAggAdvertiseKeysTask(setup=pb.SecAggSetup(
        round_id=ROUND_ID, identities=["a"] * (_secagg_codec.MAX_PARTICIPANTS + 1)))),
], ids=["shares", "commitments", "roster", "survivors", "confirmations", "participants",
        "identities"])
def test_too_many_listed_items_are_invalid(build: Any) -> None:
    _refused(codec.task_from_proto, build(), "at most")


def test_too_many_listed_share_commitments_in_a_result_are_invalid() -> None:
    result = pb.SecAggShareKeysResult(round_id=ROUND_ID, client_id="client-000",
                                      self_mask_commitment=b"c" * 32,
                                      share_commitments=[_commitment()] * _TOO_MANY)
    _refused(codec.result_from_proto, _result_with("secagg_share_keys", result), "at most")


# ---- payloads ------------------------------------------------------------------------
def test_a_stage_reply_other_than_the_masked_input_carries_no_payload() -> None:
    header = _result_with("secagg_advertised_keys", _keys())
    header.update.CopyFrom(codec.payload_to_proto(_masked_info(4)))
    _refused(codec.result_from_proto, header, "only a masked input")


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
        SESSION, "t" * 32, 1, TaskKind.SECAGG, update=_masked_info(4),
        secagg=MaskedInputHeader(RoundId("run-1", 1, 0), "client-000"))).result
    header.ClearField("update")
    if update is not None:
        header.update.CopyFrom(codec.payload_to_proto(update))
    _refused(codec.result_from_proto, header)
