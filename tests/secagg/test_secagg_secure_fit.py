"""The client's stage runner (`SecureFit`) checks what the server sends before it acts.

Each refusal comes back as a task failure (the server then treats the client as a
dropout) and the application's `fit` is not run for a task that does not add up: in
particular for a model or fit config other than the one the round's setup binds (a
server that sends one client another model than the others).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
import pytest
from e2e_harness import RecordingClient
from helpers import small_weights

from fedloom.client_sdk.secure_fit import SecureFit
from fedloom.messages import MaskedInputHeader, Session, TaskHeader
from fedloom.payload import PayloadInfo, serialize
from fedloom.secagg import (
    AdvertisedKeys,
    AdvertiseKeysRequest,
    KeyOffer,
    MaskedInputRequest,
    RoundId,
    RoundSetup,
    SecAggConfig,
    ShareKeysRequest,
    clip_delta,
    config_digest,
    model_digest,
)
from fedloom.types import TaskKind
from fedloom.weights import Weights

CONFIG = SecAggConfig(enabled=True, neighbours=4, threshold=3, max_weight=100.0,
                      max_participants=16, bits=24)
IDS = [f"c{i}" for i in range(6)]
SESSION = Session("c0", b"s" * 32)


def _task(request: Any, run_id: str = "run", server_round: int = 1,
          config: dict[str, Any] | None = None) -> TaskHeader:
    weights = small_weights()
    payload = serialize(weights)
    return TaskHeader("t" * 32, run_id, server_round, TaskKind.SECAGG,
                      config or {"server_round": server_round}, 30.0,
                      PayloadInfo.describe(weights.specs(), payload), secagg=request)


def _model(weights: Weights) -> bytes:
    return model_digest(weights.specs(), PayloadInfo.describe(weights.specs(),
                                                              serialize(weights)).sha256)


def _advertise(length: int = 15, participants: list[str] | None = None,
               round_id: RoundId | None = None, weights: Weights | None = None,
               config: dict[str, Any] | None = None) -> AdvertiseKeysRequest:
    """Stage 1 of an unauthenticated attempt that binds ``weights`` (default: the model
    `_task` delivers) and ``config`` (default: `_task`'s)."""
    rid = round_id or RoundId("run", 1, 0)
    setup = RoundSetup.create(
        dataclasses.replace(CONFIG, allow_unauthenticated=True), rid, participants or IDS,
        length, model_digest=_model(weights or small_weights()),
        config_digest=config_digest(config or {"server_round": rid.server_round}))
    return AdvertiseKeysRequest(setup)


def _run(request: Any, **task: Any) -> tuple[RecordingClient, Any]:
    client = RecordingClient(seed=0, num_examples=10)
    result, payload = SecureFit(client, "c0").execute(SESSION, _task(request, **task),
                                                      small_weights())
    return client, (result, payload)


def test_stage_one_advertises_fresh_keys_without_training() -> None:
    client, (result, payload) = _run(_advertise())
    assert isinstance(result.secagg, AdvertisedKeys) and payload is None
    assert result.kind is TaskKind.SECAGG and dict(result.metrics) == {}  # no fit metrics
    assert client.sent == []  # training waits for the masked-input stage


def test_a_request_for_another_round_or_run_is_refused_before_training() -> None:
    for task in ({"server_round": 2}, {"run_id": "other"}):
        client, (result, _payload) = _run(_advertise(), **task)
        assert result.kind is None and "its task is" in result.failure
        assert client.sent == []


def _masked_input_after(advertise: AdvertiseKeysRequest, client: RecordingClient,
                        round_id: RoundId | None = None, fit: SecureFit | None = None,
                        **task: Any) -> Any:
    """Advertise keys, then run a masked-input task (no shares) on the same runner."""
    fit = fit or SecureFit(client, "c0")
    keys, _ = fit.execute(SESSION, _task(advertise, server_round=advertise.round_id.server_round),
                          small_weights())
    assert isinstance(keys.secagg, AdvertisedKeys)
    request = MaskedInputRequest(round_id or advertise.setup.round_id, (), ())
    result, _ = fit.execute(SESSION, _task(request, **task), small_weights())
    return result


def test_a_round_that_does_not_match_the_model_is_refused_before_training() -> None:
    client = RecordingClient(seed=0, num_examples=10)
    result = _masked_input_after(_advertise(length=16), client)
    assert result.kind is None and "the model has 15" in result.failure
    assert client.sent == []


def test_a_round_without_this_client_is_refused() -> None:
    client, (result, _) = _run(_advertise(participants=[*IDS[1:], "c9"]))
    assert result.kind is None and "not among the round's participants" in result.failure
    assert client.sent == []


def test_a_client_with_more_examples_than_max_weight_refuses() -> None:
    result = _masked_input_after(_advertise(), RecordingClient(seed=0, num_examples=101))
    assert result.kind is None and "max_weight" in result.failure


def test_a_masked_input_request_without_advertised_keys_is_refused() -> None:
    client, (result, _) = _run(MaskedInputRequest(RoundId("run", 1, 0), (), ()))
    assert result.kind is None and "no keys were shared" in result.failure
    assert client.sent == []


def test_a_masked_input_request_for_another_attempt_is_refused_before_training() -> None:
    client = RecordingClient(seed=0, num_examples=10)
    result = _masked_input_after(_advertise(), client, round_id=RoundId("run", 1, 1))
    assert result.kind is None and "no keys were shared" in result.failure
    assert client.sent == []


def test_another_model_than_the_setup_binds_is_refused_before_training() -> None:
    """The attack of model inconsistency (Pasquini et al., CCS 2022): the victim gets
    another model than the others. Its setup binds the others' model, so it refuses."""
    other = Weights((k, v + 1) for k, v in small_weights().items())
    client = RecordingClient(seed=0, num_examples=10)
    result = _masked_input_after(_advertise(weights=other), client)
    assert result.kind is None and "not the one its setup binds" in result.failure
    assert client.sent == []


def test_another_fit_config_than_the_setup_binds_is_refused_before_training() -> None:
    client = RecordingClient(seed=0, num_examples=10)
    result = _masked_input_after(_advertise(), client,
                                 config={"server_round": 1, "lr": 10.0})
    assert result.kind is None and "fit config" in result.failure
    assert client.sent == []


def test_a_retried_attempt_of_the_round_masks_the_update_trained_once() -> None:
    client = RecordingClient(seed=0, num_examples=10)
    fit = SecureFit(client, "c0")
    first = _masked_input_after(_advertise(), client, fit=fit)
    assert len(client.sent) == 1 and "out of order" in first.failure
    again = _masked_input_after(_advertise(round_id=RoundId("run", 1, 1)), client, fit=fit)
    assert len(client.sent) == 1 and "out of order" in again.failure  # not trained again
    _masked_input_after(_advertise(round_id=RoundId("run", 2, 2),
                                   config={"server_round": 2}), client, fit=fit,
                        server_round=2, config={"server_round": 2})
    assert len(client.sent) == 2  # a new round trains


def test_a_client_without_a_certificate_refuses_an_authenticated_round() -> None:
    setup = _advertise().setup
    signed = dataclasses.replace(setup, authenticated=True)
    _client, (result, _) = _run(AdvertiseKeysRequest(signed))
    assert result.kind is None and "no certificate" in result.failure


def test_stage_three_trains_then_the_protocol_checks_its_request() -> None:
    """With keys advertised, the masked-input task trains on its weights; the protocol
    then refuses a masked-input request that skips share keys (no input is sent)."""
    client = RecordingClient(seed=0, num_examples=10)
    result = _masked_input_after(_advertise(), client)
    assert len(client.sent) == 1  # trained on the task's weights
    assert result.kind is None and "out of order" in result.failure


def test_the_norm_bound_clips_floating_tensors_only() -> None:
    delta = Weights({"w": np.array([3.0, 4.0], np.float32), "n": np.array([7], np.int64)})
    clipped = clip_delta(delta, 1.0)
    assert np.allclose(clipped["w"], [0.6, 0.8]) and clipped["n"].tolist() == [7]
    assert clip_delta(delta, 10.0) is delta


def test_the_masked_payload_is_one_uint32_vector() -> None:
    from fedloom.secagg import MaskedInputReply

    fit = SecureFit(RecordingClient(seed=0, num_examples=10), "c0")
    masked = np.arange(16, dtype=np.uint32)
    header, payload, info = fit._masked_payload(
        MaskedInputReply(RoundId("run", 1, 0), "c0", masked))
    assert header == MaskedInputHeader(RoundId("run", 1, 0), "c0")
    assert bytes(payload) == masked.astype("<u4").tobytes()
    assert info.specs[0].dtype == "uint32" and info.specs[0].shape == (16,)
    assert info.sha256 == hashlib.sha256(masked.tobytes()).digest()


def test_a_share_task_on_keys_never_offered_is_refused_and_nothing_trains() -> None:
    setup = _advertise().setup
    own = KeyOffer(b"\1" * 32, b"\2" * 32).advertised(setup.round_id, "c0")
    client = RecordingClient(seed=0, num_examples=10)
    fit = SecureFit(client, "c0")
    result, _ = fit.execute(SESSION, _task(ShareKeysRequest(setup.round_id, (), setup, own)),
                            small_weights())
    assert result.kind is None and "never offered" in result.failure
    masked = MaskedInputRequest(setup.round_id, (), ())
    result, _ = fit.execute(SESSION, _task(masked), small_weights())
    assert result.kind is None and "no keys were shared" in result.failure
    assert client.sent == []


def test_a_fit_that_returns_no_fit_output_fails_its_task_not_the_client() -> None:
    """As in a plain round (`run_fit`): a ValueError the runner turns into a task
    failure, where an AttributeError from inside the SDK ended ``run()``."""

    class ReturnsNothing(RecordingClient):
        def fit(self, weights: Weights, config: Any) -> Any:
            super().fit(weights, config)
            return None

    client = ReturnsNothing(seed=0, num_examples=10)
    with pytest.raises(ValueError, match="ReturnsNothing.fit returned NoneType, not a "
                                         r"FitOutput\(weights, num_examples, metrics\)"):
        _masked_input_after(_advertise(), client)
    assert len(client.sent) == 1
