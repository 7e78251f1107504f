"""The secure-aggregation stages of real rounds on the wire: codec round trips, and the
rounds' setups and messages made hostile.

Every request and reply of real in-process rounds (the state machines' own messages)
goes through `codec` to protobuf bytes and back and must come out equal: an
authenticated round (all five stages, signed keys, confirmations), an unauthenticated
one (no consistency stage, key offers) and the next unauthenticated attempt, which runs
on those offers. Their setups and stage messages, made malformed, are refused with
INVALID, never with another exception.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from secagg_driver import ids_of, make_inputs, run, setup_round
from secagg_wire_support import EMPTY, SESSION, SIGNATURE, masked_info, refused, task_with

from fedloom.messages import MaskedInputHeader, ResultHeader, TaskHeader
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
from fedloom.types import TaskKind

Transcript = list[tuple[Stage, str, Any, Any]]

CONFIG = SecAggConfig(neighbours=4, threshold=3, max_participants=16, bits=20)
#: The stages each recorded round runs.
STAGES = {
    "authenticated": set(Stage),
    "unauthenticated": set(Stage) - {Stage.CONSISTENCY},
    "on_offers": {Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASK},
}


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


def _result_proto(reply: Any) -> pb.ResultHeader:
    """``reply`` as a result header (a masked input as its header and payload info)."""
    if isinstance(reply, MaskedInputReply):
        return codec.result_to_proto(ResultHeader(
            SESSION, "t" * 32, 1, TaskKind.SECAGG, update=masked_info(len(reply.masked)),
            secagg=MaskedInputHeader(reply.round_id, reply.client_id))).result
    return codec.result_to_proto(ResultHeader(SESSION, "t" * 32, 1, TaskKind.SECAGG,
                                              secagg=reply)).result


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
            assert back.update == masked_info(len(reply.masked))
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
    refused(codec.task_from_proto,
            task_with("secagg_advertise_keys", pb.SecAggAdvertiseKeysTask(setup=setup)))


def test_a_setup_must_name_one_identity_per_participant(rounds: dict[str, Transcript]) -> None:
    setup = _secagg_codec.round_setup_to_proto(_setup_of(rounds))
    del setup.identities[-1]
    refused(_secagg_codec.round_setup_from_proto, setup, "one identity per participant")


def test_an_authenticated_setup_seats_every_identity_once(
        rounds: dict[str, Transcript]) -> None:
    setup = _secagg_codec.round_setup_to_proto(_setup_of(rounds))
    setup.identities[1] = setup.identities[0]
    refused(_secagg_codec.round_setup_from_proto, setup, "every identity once")


def test_an_unsorted_or_missing_setup_is_invalid(rounds: dict[str, Transcript]) -> None:
    setup = _secagg_codec.round_setup_to_proto(_setup_of(rounds))
    unsorted = pb.SecAggSetup()
    unsorted.CopyFrom(setup)
    unsorted.participants[0], unsorted.participants[1] = setup.participants[1], \
        setup.participants[0]
    refused(_secagg_codec.round_setup_from_proto, unsorted, "sorted")
    refused(codec.task_from_proto,
            task_with("secagg_advertise_keys", pb.SecAggAdvertiseKeysTask()), "setup")


def test_a_share_keys_task_with_a_setup_but_no_own_keys_is_invalid(
        rounds: dict[str, Transcript]) -> None:
    setup = _setup_of(rounds)
    header = codec.task_to_proto(_task(ShareKeysRequest(setup.round_id, ()))).task
    header.secagg_share_keys.setup.CopyFrom(_secagg_codec.round_setup_to_proto(setup))
    refused(codec.task_from_proto, header, "both the setup and the client's own keys")


def test_every_stage_message_must_name_its_round(rounds: dict[str, Transcript]) -> None:
    """A task or result whose round_id submessage is missing is refused, stage by stage."""
    tasks, results = set(), set()
    for stage, _cid, request, reply in rounds["authenticated"]:
        task = codec.task_to_proto(_task(request)).task
        task_kind = task.WhichOneof("kind")
        assert task_kind is not None
        inner = getattr(task, task_kind)
        (inner.setup if stage is Stage.ADVERTISE_KEYS else inner).ClearField("round_id")
        refused(codec.task_from_proto, task, "round_id is missing")
        result = _result_proto(reply)
        result_kind = result.WhichOneof("kind")
        assert result_kind is not None
        getattr(result, result_kind).ClearField("round_id")
        refused(codec.result_from_proto, result, "round_id is missing")
        tasks.add(task_kind)
        results.add(result_kind)
    assert len(tasks) == len(results) == len(Stage)
