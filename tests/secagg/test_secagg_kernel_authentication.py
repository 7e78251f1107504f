"""Who takes part in which attempt: authenticated and unauthenticated clients, the
identities a setup seats, signed keys and confirmations at the server, the per-round cap
on attempts, and the model and fit config a setup binds."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
import pytest
from secagg_driver import (
    CONFIG_DIGEST,
    MODEL_DIGEST,
    Round,
    assert_matches_plaintext,
    exactly,
    ids_of,
    make_client,
    make_inputs,
    make_setup,
    pki,
    run,
    setup_round,
)

from fedloom import certs
from fedloom.errors import MessageRejectedError, RejectReason, SecureAggregationError
from fedloom.secagg import (
    AdvertisedKeys,
    AdvertiseKeysRequest,
    ConsistencyReply,
    RoundId,
    RoundSetup,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    SigningIdentity,
    Stage,
    config_digest,
    key_statement,
    model_digest,
)
from fedloom.secagg._encoding import pack
from fedloom.weights import TensorSpec

CONFIG = SecAggConfig(enabled=True, neighbours=6, threshold=4, clip_range=3.0, bits=20,
                      max_weight=100.0, max_participants=64)
LABEL = b"fedloom/secagg/v4/"

BOTH_MODES = pytest.mark.parametrize("authenticated", [True, False],
                                     ids=["authenticated", "unauthenticated"])


# -- which client takes part in which kind of attempt ---------------------------------


def test_a_client_with_a_certificate_refuses_an_unauthenticated_attempt() -> None:
    ids = ids_of(8)
    client = make_client(ids[0])
    why = ("client 'client-000' refuses: this client holds a certificate and takes part only "
           "in rounds whose keys are signed; an unauthenticated round would let the server "
           "substitute keys unseen")
    with pytest.raises(SecureAggregationError, match=exactly(why)):
        client.handle(AdvertiseKeysRequest(make_setup(CONFIG, ids, 4, authenticated=False)))
    signed = client.handle(AdvertiseKeysRequest(make_setup(CONFIG, ids, 4)))
    assert isinstance(signed, AdvertisedKeys) and signed.signed


def test_a_client_without_a_certificate_refuses_an_authenticated_attempt() -> None:
    ids = ids_of(8)
    client = make_client(ids[0], authenticated=False)
    with pytest.raises(SecureAggregationError, match="no certificate to sign with"):
        client.handle(AdvertiseKeysRequest(make_setup(CONFIG, ids, 4)))
    plain = client.handle(AdvertiseKeysRequest(make_setup(CONFIG, ids, 4,
                                                          authenticated=False)))
    assert isinstance(plain, AdvertisedKeys) and not plain.signed
    assert plain.certificate == b"" and plain.signature == b""


def test_a_refused_kind_of_attempt_does_not_end_the_attempt_in_progress() -> None:
    ids = ids_of(8)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 8)), stop_at=Stage.MASKED_INPUT)
    other = make_setup(CONFIG, ids, 8, RoundId("run-1", 1, 5), authenticated=False)
    with pytest.raises(SecureAggregationError, match="only in rounds whose keys are signed"):
        rnd.clients[ids[0]].handle(AdvertiseKeysRequest(other))
    run(rnd)
    assert_matches_plaintext(CONFIG, rnd, ids)


def test_a_client_seated_under_another_identity_refuses() -> None:
    ids = ids_of(8)
    setup = RoundSetup.create(CONFIG, RoundId("run-1", 1, 1), ids, 4, model_digest=MODEL_DIGEST,
                              config_digest=CONFIG_DIGEST, identities={ids[0]: "site-a"},
                              authenticated=True)
    with pytest.raises(SecureAggregationError, match="certificate names 'client-000'"):
        make_client(ids[0]).handle(AdvertiseKeysRequest(setup))


def test_a_client_with_a_certificate_needs_the_client_ca() -> None:
    why = ("a client with a certificate needs the client CA (peers) to check the other "
           "participants' signatures")
    with pytest.raises(SecureAggregationError, match=exactly(why)):
        SecAggClient("client-000", identity=pki().identity("client-000"))


def test_an_authenticated_server_needs_the_client_ca() -> None:
    with pytest.raises(SecureAggregationError, match="needs the client CA"):
        SecAggServer(make_setup(CONFIG, ids_of(8), 4))
    SecAggServer(make_setup(CONFIG, ids_of(8), 4, authenticated=False))  # needs none


def test_participants_seated_under_their_certificates_names() -> None:
    """The setup seats each client id under an identity (its certificate's name), which
    need not be the id: a round of such clients finishes."""
    ids = ids_of(8)
    names = {cid: f"site-{chr(ord('a') + i)}" for i, cid in enumerate(ids)}
    setup = RoundSetup.create(CONFIG, RoundId("run-1", 1, 1), ids, 6, model_digest=MODEL_DIGEST,
                              config_digest=CONFIG_DIGEST, identities=names,
                              authenticated=True)
    clients = {cid: SecAggClient(cid, identity=pki().identity(names[cid]), peers=pki().verifier,
                                 rng=np.random.default_rng(i)) for i, cid in enumerate(ids)}
    rnd = run(Round(SecAggServer(setup, verifier=pki().verifier), clients,
                    make_inputs(ids, 6)))
    assert_matches_plaintext(CONFIG, rnd, ids)
    keys = [r for _, _, _, r in rnd.transcript if isinstance(r, AdvertisedKeys)]
    assert {pki().verifier.verify_certificate(k.certificate).name for k in keys} == set(
        names.values())


# -- what an authenticated server accepts as advertised keys and confirmations --------


def _advertised(rnd: Round, cid: str) -> AdvertisedKeys:
    keys = rnd.clients[cid].handle(rnd.server.request_for(cid))
    assert isinstance(keys, AdvertisedKeys)
    return keys


def _signed_by(identity: SigningIdentity, setup: RoundSetup, keys: AdvertisedKeys,
               certificate: bytes | None = None) -> AdvertisedKeys:
    signature = identity.sign(key_statement(setup, keys.client_id, keys.cipher_public_key,
                                            keys.mask_public_key))
    return dataclasses.replace(keys, certificate=certificate or identity.certificate_der,
                               signature=signature)


@pytest.mark.parametrize(("how", "reason", "match"), [
    ("unsigned", RejectReason.INVALID, "needs signed keys"),
    ("another-attempt", RejectReason.INVALID, "does not verify"),
    ("another-client", RejectReason.FORBIDDEN, "certificate names 'client-001'"),
    ("another-key", RejectReason.INVALID, "does not verify"),
    ("another-ca", RejectReason.INVALID, "not valid under the client CA"),
    ("server-certificate", RejectReason.INVALID, "not valid under the client CA"),
])
def test_an_authenticated_server_refuses_keys_not_signed_by_the_seated_client(
        how: str, reason: RejectReason, match: str) -> None:
    ids = ids_of(8)
    rnd = setup_round(CONFIG, make_inputs(ids, 4))
    setup, cid = rnd.server.setup, ids[0]
    keys = _advertised(rnd, cid)
    mine = pki().identity(cid)
    if how == "unsigned":
        bad = dataclasses.replace(keys, certificate=b"", signature=b"")
    elif how == "another-attempt":
        later = dataclasses.replace(setup, round_id=RoundId("run-1", 1, 2))
        bad = _signed_by(mine, later, keys)
    elif how == "another-client":  # a valid certificate, of another participant
        bad = _signed_by(pki().identity(ids[1]), setup, keys)
    elif how == "another-key":  # this client's certificate, someone else's signature
        bad = _signed_by(pki().identity(ids[1]), setup, keys, mine.certificate_der)
    elif how == "another-ca":
        issued = certs.make_client_cert(certs.make_ca("rogue CA"), cid)
        bad = _signed_by(SigningIdentity(issued.cert, issued.key), setup, keys)
    else:
        issued = certs.make_server_cert(pki().ca)
        bad = _signed_by(SigningIdentity(issued.cert, issued.key), setup, keys)
    with pytest.raises(MessageRejectedError, match=match) as info:
        rnd.server.receive(cid, bad)
    assert info.value.reason is reason
    rnd.server.receive(cid, keys)  # the client's own signed keys are still taken


def test_an_unauthenticated_server_refuses_signed_keys() -> None:
    ids = ids_of(8)
    signed = setup_round(CONFIG, make_inputs(ids, 4))
    keys = _advertised(signed, ids[0])
    plain = setup_round(CONFIG, make_inputs(ids, 4), authenticated=False)
    unsigned = _advertised(plain, ids[0])
    moved = dataclasses.replace(keys, round_id=plain.server.setup.round_id)
    with pytest.raises(MessageRejectedError, match="signed keys in an unauthenticated"):
        plain.server.receive(ids[0], moved)
    plain.server.receive(ids[0], unsigned)


def test_a_confirmation_that_does_not_verify_is_refused() -> None:
    ids = ids_of(8)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 4)), stop_at=Stage.CONSISTENCY)
    server, cid = rnd.server, ids[0]
    reply = rnd.clients[cid].handle(server.request_for(cid))
    assert isinstance(reply, ConsistencyReply)
    # a neighbour's confirmation of the same set, sent in this client's name
    other = rnd.clients[ids[1]].handle(server.request_for(ids[1]))
    assert isinstance(other, ConsistencyReply)
    forged = dataclasses.replace(reply, signature=other.signature)
    with pytest.raises(MessageRejectedError, match="does not verify") as info:
        server.receive(cid, forged)
    assert info.value.reason is RejectReason.INVALID
    server.receive(cid, reply)
    server.receive(ids[1], other)
    run(rnd)
    assert_matches_plaintext(CONFIG, rnd, ids)


# -- at most max_attempts attempts of one round ----------------------------------------


@BOTH_MODES
def test_a_client_takes_part_in_at_most_max_attempts_attempts_of_a_round(
        authenticated: bool) -> None:
    ids = ids_of(8)
    policy = dataclasses.replace(CONFIG, max_attempts=2)
    client = make_client(ids[0], authenticated=authenticated, policy=policy)

    def advertise(server_round: int, attempt: int) -> Any:
        setup = make_setup(CONFIG, ids, 4, RoundId("run-1", server_round, attempt),
                           authenticated=authenticated)
        return client.handle(AdvertiseKeysRequest(setup))

    assert isinstance(advertise(1, 1), AdvertisedKeys)
    current = advertise(1, 4)  # attempt ids need not be consecutive
    assert isinstance(current, AdvertisedKeys)
    why = ("client 'client-000' refuses: this client already took part in 2 attempts of "
           "round 1 (max_attempts): every attempt shows the server a sum over its survivors, "
           "so it takes part in no more")
    with pytest.raises(SecureAggregationError, match=exactly(why)):
        advertise(1, 5)
    # the refusal leaves the attempt in progress alone
    assert client.setup is not None and client.setup.round_id == RoundId("run-1", 1, 4)
    assert advertise(1, 4) is current  # a retry of its request: the same reply
    assert isinstance(advertise(2, 1), AdvertisedKeys)  # the next round counts afresh
    other_run = make_setup(CONFIG, ids, 4, RoundId("run-2", 1, 9), authenticated=authenticated)
    assert isinstance(client.handle(AdvertiseKeysRequest(other_run)), AdvertisedKeys)


def test_without_a_policy_the_default_caps_attempts_at_three() -> None:
    ids = ids_of(8)
    client = make_client(ids[0])
    for attempt in range(1, SecAggConfig().max_attempts + 1):
        client.handle(AdvertiseKeysRequest(make_setup(CONFIG, ids, 4,
                                                      RoundId("run-1", 1, attempt))))
    with pytest.raises(SecureAggregationError, match="max_attempts"):
        client.handle(AdvertiseKeysRequest(make_setup(CONFIG, ids, 4, RoundId("run-1", 1, 9))))


def test_an_attempt_refused_for_its_parameters_does_not_count() -> None:
    ids = ids_of(8)
    policy = dataclasses.replace(CONFIG, max_attempts=1)
    client = make_client(ids[0], policy=policy)
    wrong = make_setup(dataclasses.replace(CONFIG, threshold=5), ids, 4, RoundId("run-1", 1, 1))
    with pytest.raises(SecureAggregationError, match="differ"):
        client.handle(AdvertiseKeysRequest(wrong))
    ok = make_setup(CONFIG, ids, 4, RoundId("run-1", 1, 2))
    assert isinstance(client.handle(AdvertiseKeysRequest(ok)), AdvertisedKeys)


# -- the survivor floor ------------------------------------------------------------------


@BOTH_MODES
def test_the_server_fails_an_attempt_below_min_survivors(authenticated: bool) -> None:
    config = dataclasses.replace(CONFIG, min_survivors=10)
    ids = ids_of(12)
    rnd = setup_round(config, make_inputs(ids, 4), authenticated=authenticated)
    assert rnd.server.setup.min_survivors == 10
    with pytest.raises(SecureAggregationError, match="min_survivors = 10"):
        run(rnd, drop_at=dict.fromkeys(ids[:3], Stage.MASKED_INPUT))
    ok = setup_round(config, make_inputs(ids, 4), authenticated=authenticated)
    run(ok, drop_at=dict.fromkeys(ids[:2], Stage.MASKED_INPUT))  # 10 survivors: enough
    assert_matches_plaintext(config, ok, ids[2:])


# -- the model and fit config a setup binds --------------------------------------------


def _restated_config_digest(config: dict[str, Any]) -> bytes:
    """Independent restatement of the documented encoding: the count, then per key in
    sorted order the key, the value's type name ("bool" for booleans) and the value."""
    parts: list[Any] = [len(config)]
    for key in sorted(config):
        value = config[key]
        if isinstance(value, bool):
            parts += [key, "bool", int(value)]
        else:
            parts += [key, type(value).__name__, value]
    return hashlib.sha256(LABEL + b"fit-config" + pack(*parts)).digest()


def test_config_digest_is_canonical_and_typed() -> None:
    config = {"lr": 0.1, "epochs": 2, "name": "sgd", "blob": b"\0", "nesterov": True}
    digest = config_digest(config)
    assert digest == _restated_config_digest(config)
    assert config_digest(dict(reversed(list(config.items())))) == digest  # order-free
    variants = [{"flag": True}, {"flag": 1}, {"flag": 1.0}, {"flag": "1"}, {"flag": b"1"},
                {"flag": False}, {"flag": 0}, {"flag": 0.0}, {"other": True}, {}]
    digests = {config_digest(v) for v in variants}
    assert len(digests) == len(variants)  # bool, int, float, str and bytes never collide
    assert config_digest({"a": 1, "b": 2}) != config_digest({"a": 2, "b": 1})
    for bad in ([1], None, {"x": 1}):
        with pytest.raises(TypeError, match="fit config value 'x'"):
            config_digest({"x": bad})


def test_model_digest_changes_with_names_dtypes_shapes_and_bytes() -> None:
    specs = [TensorSpec("w", "float32", (3, 4)), TensorSpec("b", "float32", (4,))]
    payload = hashlib.sha256(b"model bytes").digest()
    digest = model_digest(specs, payload)
    fields: list[Any] = [2, "w", "float32", 2, 3, 4, "b", "float32", 1, 4, payload]
    assert digest == hashlib.sha256(LABEL + b"model" + pack(*fields)).digest()
    variants = [
        [TensorSpec("v", "float32", (3, 4)), specs[1]],  # a name
        [TensorSpec("w", "float64", (3, 4)), specs[1]],  # a dtype
        [TensorSpec("w", "float32", (4, 3)), specs[1]],  # a shape
        [TensorSpec("w", "float32", (12,)), specs[1]],  # the same size, another rank
        [specs[1], specs[0]],  # the order
        specs[:1],  # a tensor fewer
    ]
    digests = {model_digest(v, payload) for v in variants}
    digests.add(model_digest(specs, hashlib.sha256(b"other bytes").digest()))
    assert digest not in digests and len(digests) == len(variants) + 1


def test_the_setup_binds_the_model_and_the_config_into_what_clients_sign() -> None:
    ids = ids_of(8)
    setup = make_setup(CONFIG, ids, 4)
    assert (setup.model_digest, setup.config_digest) == (MODEL_DIGEST, CONFIG_DIGEST)
    cipher, mask = b"\1" * 32, b"\2" * 32
    statement = key_statement(setup, ids[0], cipher, mask)
    for change in ({"model_digest": hashlib.sha256(b"m2").digest()},
                   {"config_digest": config_digest({"lr": 0.2})}):
        other = dataclasses.replace(setup, **change)
        assert key_statement(other, ids[0], cipher, mask) != statement
