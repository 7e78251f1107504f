"""The secure-aggregation stages on the wire: codec round trips and hostile headers.

Every request and reply of a real in-process round (the state machines' own messages)
goes through `codec` to protobuf bytes and back and must come out equal; malformed
stage messages are refused with INVALID, never with another exception.
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
    KeyOffer,
    MaskedInputReply,
    RoundId,
    SecAggConfig,
    ShareKeysReply,
    ShareKeysRequest,
    Stage,
)
from fedloom.types import TaskKind
from fedloom.weights import TensorSpec

SESSION = Session("client-000", b"s" * 32)
EMPTY = PayloadInfo((), 0, hashlib.sha256(b"").digest())


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


@pytest.fixture(scope="module")
def transcript() -> list[tuple[Stage, str, Any, Any]]:
    config = SecAggConfig(neighbours=4, threshold=3, max_participants=16, bits=20)
    inputs = make_inputs(ids_of(7), 9, seed=3)
    rnd = run(setup_round(config, inputs, RoundId("run-1", 1, 5)),
              drop_at={"client-006": Stage.MASKED_INPUT})  # so unmask lists a dropped one
    return rnd.transcript


def test_every_request_of_a_real_round_round_trips(transcript) -> None:  # type: ignore[no-untyped-def]
    stages = set()
    for stage, _cid, request, _reply in transcript:
        config = {"server_round": 1, "lr": 0.1} if stage is Stage.MASKED_INPUT else {}
        back = _through_wire_task(_task(request, config))
        assert back.kind is TaskKind.SECAGG
        assert back.secagg == request
        assert dict(back.config) == config
        stages.add(stage)
    assert stages == set(Stage)


def test_every_reply_of_a_real_round_round_trips(transcript) -> None:  # type: ignore[no-untyped-def]
    for _stage, cid, _request, reply in transcript:
        if isinstance(reply, MaskedInputReply):
            header = MaskedInputHeader(reply.round_id, reply.client_id)
            back = _through_wire_result(ResultHeader(
                SESSION, "t" * 32, 1, TaskKind.SECAGG, update=_masked_info(len(reply.masked)),
                secagg=header))
            assert back.secagg == header
            assert back.update == _masked_info(len(reply.masked))
        else:
            back = _through_wire_result(ResultHeader(SESSION, "t" * 32, 1, TaskKind.SECAGG,
                                                     secagg=reply))
            assert back.secagg == reply
            assert back.update is None
        assert back.kind is TaskKind.SECAGG and back.session == SESSION and cid


def test_the_setup_keeps_its_digest_through_the_wire(transcript) -> None:  # type: ignore[no-untyped-def]
    request = next(r for s, _, r, _ in transcript if s is Stage.ADVERTISE_KEYS)
    assert isinstance(request, AdvertiseKeysRequest)
    back = _through_wire_task(_task(request)).secagg
    assert isinstance(back, AdvertiseKeysRequest)
    assert back.setup.digest == request.setup.digest


def _keys_result(**changes: Any) -> pb.ResultHeader:
    keys = pb.SecAggAdvertisedKeys(
        round_id=pb.SecAggRoundId(run_id="run-1", round=1, attempt=0), client_id="client-000",
        cipher_public_key=b"a" * 32, mask_public_key=b"b" * 32)
    for name, value in changes.items():
        setattr(keys, name, value)
    header = codec.result_to_proto(ResultHeader(SESSION, "t" * 32, 1, None, failure="x")).result
    header.secagg_advertised_keys.CopyFrom(keys)
    return header


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"cipher_public_key": b"short"}, "cipher_public_key must be 32 bytes"),
        ({"mask_public_key": b"a" * 32}, "must differ"),
        ({"client_id": ""}, "client_id"),
        ({"client_id": "x" * 300}, "client_id"),
    ],
)
def test_malformed_keys_are_invalid(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(MessageRejectedError, match=match) as info:
        codec.result_from_proto(_keys_result(**changes))
    assert info.value.reason is RejectReason.INVALID


def test_round_numbers_beyond_64_bits_are_invalid() -> None:
    header = _keys_result()
    header.secagg_advertised_keys.round_id.attempt = (1 << 64) - 1
    with pytest.raises(MessageRejectedError, match="out of range"):
        codec.result_from_proto(header)


def test_a_stage_reply_other_than_the_masked_input_carries_no_payload() -> None:
    header = _keys_result()
    header.update.CopyFrom(codec.payload_to_proto(_masked_info(4)))
    with pytest.raises(MessageRejectedError, match="only a masked input"):
        codec.result_from_proto(header)


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
    with pytest.raises(MessageRejectedError) as info:
        codec.result_from_proto(header)
    assert info.value.reason is RejectReason.INVALID


def test_a_setup_with_bad_parameters_is_invalid(transcript) -> None:  # type: ignore[no-untyped-def]
    request = next(r for s, _, r, _ in transcript if s is Stage.ADVERTISE_KEYS)
    wire = codec.task_to_proto(_task(request)).task
    for field, value in (("threshold", 1), ("bits", 40), ("clip_range", float("nan")),
                         ("graph_seed", b"short")):
        bad = pb.TaskHeader()
        bad.CopyFrom(wire)
        setattr(bad.secagg_advertise_keys.setup, field, value)
        with pytest.raises(MessageRejectedError) as info:
            codec.task_from_proto(bad)
        assert info.value.reason is RejectReason.INVALID, field
    unsorted = pb.TaskHeader()
    unsorted.CopyFrom(wire)
    participants = unsorted.secagg_advertise_keys.setup.participants
    participants[0], participants[1] = participants[1], participants[0]
    with pytest.raises(MessageRejectedError, match="sorted"):
        codec.task_from_proto(unsorted)
    missing = pb.TaskHeader()
    missing.CopyFrom(wire)
    missing.secagg_advertise_keys.ClearField("setup")
    with pytest.raises(MessageRejectedError, match="setup"):
        codec.task_from_proto(missing)


def test_too_many_listed_shares_are_invalid() -> None:
    share = pb.SecAggEncryptedShare(sender="a", receiver="b", nonce=b"n" * 12, ciphertext=b"c")
    task = pb.TaskHeader(task_id="t", run_id="r", round=1,
                         weights=codec.payload_to_proto(EMPTY))
    task.secagg_masked_input.round_id.CopyFrom(pb.SecAggRoundId(run_id="r", round=1))
    task.secagg_masked_input.shares.extend([share] * ((1 << 16) + 1))
    with pytest.raises(MessageRejectedError, match="at most"):
        codec.task_from_proto(task)


def test_an_advertised_key_message_equals_its_domain_form() -> None:
    keys = AdvertisedKeys(RoundId("run-1", 2, 7), "client-001", b"\1" * 32, b"\2" * 32)
    assert _secagg_codec.advertised_keys_from_proto(
        _secagg_codec.advertised_keys_to_proto(keys)) == keys
    assert np.array_equal(np.frombuffer(keys.mask_public_key, np.uint8), np.full(32, 2))


def test_a_share_keys_task_that_skips_advertising_round_trips(transcript) -> None:  # type: ignore[no-untyped-def]
    setup = next(r for s, _, r, _ in transcript if s is Stage.ADVERTISE_KEYS).setup
    share = next(r for s, _, r, _ in transcript if s is Stage.SHARE_KEYS)
    own = KeyOffer(b"\5" * 32, b"\6" * 32).advertised(setup.round_id, setup.participants[0])
    request = ShareKeysRequest(setup.round_id, share.neighbours, setup, own)
    back = _through_wire_task(_task(request)).secagg
    assert back == request
    assert isinstance(back, ShareKeysRequest) and back.setup is not None
    assert back.setup.digest == setup.digest


def test_a_share_keys_task_with_a_setup_but_no_own_keys_is_invalid(transcript) -> None:  # type: ignore[no-untyped-def]
    setup = next(r for s, _, r, _ in transcript if s is Stage.ADVERTISE_KEYS).setup
    header = codec.task_to_proto(_task(ShareKeysRequest(setup.round_id, ()))).task
    header.secagg_share_keys.setup.CopyFrom(_secagg_codec.round_setup_to_proto(setup))
    with pytest.raises(MessageRejectedError, match="both the setup and the client's own keys"):
        codec.task_from_proto(header)


def test_share_keys_replies_carry_an_offer_and_a_commitment(transcript) -> None:  # type: ignore[no-untyped-def]
    replies = [r for s, _, _, r in transcript if s is Stage.SHARE_KEYS]
    assert replies
    for reply in replies:
        assert isinstance(reply, ShareKeysReply) and reply.next_keys is not None
        back = _through_wire_result(ResultHeader(SESSION, "t" * 32, 1, TaskKind.SECAGG,
                                                 secagg=reply)).secagg
        assert back == reply


@pytest.mark.parametrize(("field", "value", "match"), [
    ("self_mask_commitment", b"c" * 31, "self_mask_commitment must be 32 bytes"),
    ("next_keys", pb.SecAggKeyOffer(cipher_public_key=b"a" * 32, mask_public_key=b"b"),
     "mask_public_key must be 32 bytes"),
    ("next_keys", pb.SecAggKeyOffer(cipher_public_key=b"a" * 32, mask_public_key=b"a" * 32),
     "must differ"),
])
def test_a_malformed_share_keys_result_is_invalid(field: str, value: Any, match: str) -> None:
    result = pb.SecAggShareKeysResult(
        round_id=pb.SecAggRoundId(run_id="run-1", round=1, attempt=0), client_id="client-000",
        self_mask_commitment=b"c" * 32)
    if isinstance(value, bytes):
        setattr(result, field, value)
    else:
        getattr(result, field).CopyFrom(value)
    header = codec.result_to_proto(ResultHeader(SESSION, "t" * 32, 1, None, failure="x")).result
    header.secagg_share_keys.CopyFrom(result)
    with pytest.raises(MessageRejectedError, match=match) as info:
        codec.result_from_proto(header)
    assert info.value.reason is RejectReason.INVALID
