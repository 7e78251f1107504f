"""A client's own rules for keys, attempts and order: duplicate or foreign keys, used
and older attempts, stages out of order, a policy it did not agree to, erased secrets."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from clients_defend_support import BOTH_MODES, CONFIG, round_at
from secagg_driver import (
    exactly,
    ids_of,
    make_client,
    make_inputs,
    make_setup,
    pki,
    run,
    setup_round,
)

from fedloom.errors import SecureAggregationError
from fedloom.secagg import (
    AdvertisedKeys,
    AdvertiseKeysRequest,
    ConsistencyRequest,
    MaskedInputRequest,
    RoundId,
    ShareKeysReply,
    ShareKeysRequest,
    Stage,
    UnmaskRequest,
    key_statement,
)


@BOTH_MODES
def test_duplicate_or_foreign_keys_in_the_roster_are_refused(authenticated: bool) -> None:
    ids = ids_of(10)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 8), authenticated=authenticated),
              stop_at=Stage.SHARE_KEYS)
    server = rnd.server
    cid = ids[0]
    honest = server.request_for(cid)
    assert isinstance(honest, ShareKeysRequest)
    assert [k.client_id for k in honest.roster] == ids  # every member, itself included
    roster = honest.roster
    same = dataclasses.replace(roster[1], mask_public_key=roster[0].mask_public_key)
    why = (f"client {cid!r} refuses: {ids[1]!r} advertised a public key listed before (keys "
           "were substituted or replayed)")
    with pytest.raises(SecureAggregationError, match=exactly(why)):
        rnd.clients[cid].handle(ShareKeysRequest(honest.round_id,
                                                 (roster[0], same, *roster[2:])))
    other = ids[1]
    request = server.request_for(other)
    assert isinstance(request, ShareKeysRequest)
    foreign = dataclasses.replace(request.roster[-1], client_id="zz-not-a-participant")
    with pytest.raises(SecureAggregationError, match="not a participant"):
        rnd.clients[other].handle(ShareKeysRequest(request.round_id,
                                                   (*request.roster[:-1], foreign)))
    third = ids[2]
    request = server.request_for(third)
    assert isinstance(request, ShareKeysRequest)
    short = ShareKeysRequest(request.round_id, request.roster[:-1])  # ids[9] left out
    if authenticated:  # every participant's keys shape the graph: none may be left out
        why = (f"client {third!r} refuses: the roster leaves out 1 participants ({ids[9:]}): "
               "in an authenticated round every participant's keys shape the graph, so the "
               "server must start a new attempt without them rather than choose which keys "
               "count")
        with pytest.raises(SecureAggregationError, match=exactly(why)):
            rnd.clients[third].handle(short)
    else:  # a client that did not advertise is simply not a member
        assert isinstance(rnd.clients[third].handle(short), ShareKeysReply)


@BOTH_MODES
def test_used_and_older_attempts_are_refused(authenticated: bool) -> None:
    ids = ids_of(8)
    inputs = make_inputs(ids, 8)
    rnd = run(setup_round(CONFIG, inputs, round_id=RoundId("run-1", 4, 2),
                          authenticated=authenticated))
    client = rnd.clients[ids[0]]
    for attempt in (2, 1, 0):  # attempt 2 was used; 1 and 0 are older
        setup = make_setup(CONFIG, ids, 8, RoundId("run-1", 4, attempt),
                           authenticated=authenticated)
        with pytest.raises(SecureAggregationError, match="already used or is older"):
            client.handle(AdvertiseKeysRequest(setup))
    # a newer attempt of the same round is refused too: this client revealed shares in
    # round 4 already (a second sum would reveal the difference); the next round is not
    newer = make_setup(CONFIG, ids, 8, RoundId("run-1", 4, 3), authenticated=authenticated)
    why = (f"client {ids[0]!r} refuses: this client's input may be in the sum of an earlier "
           "attempt of round 4 (it revealed shares, or confirmed the survivors of a "
           "distributed-DP attempt): a second unmasked attempt would show the server a second "
           "sum, and the difference of the two its missing clients' updates")
    with pytest.raises(SecureAggregationError, match=exactly(why)):
        client.handle(AdvertiseKeysRequest(newer))
    fresh = make_setup(CONFIG, ids, 8, RoundId("run-1", 5, 4), authenticated=authenticated)
    assert isinstance(client.handle(AdvertiseKeysRequest(fresh)), AdvertisedKeys)


@BOTH_MODES
def test_out_of_order_and_foreign_rounds_are_refused(authenticated: bool) -> None:
    ids = ids_of(8)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 8), authenticated=authenticated),
              stop_at=Stage.SHARE_KEYS)
    client = rnd.clients[ids[0]]
    rid = rnd.server.setup.round_id
    with pytest.raises(SecureAggregationError, match="out of order"):
        client.handle(MaskedInputRequest(rid, (), ()), vector=np.zeros(8), num_examples=1)
    outsider = make_client("not-invited", authenticated=authenticated)
    why = "client 'not-invited' refuses: this client is not among the round's participants"
    with pytest.raises(SecureAggregationError, match=exactly(why)):
        outsider.handle(AdvertiseKeysRequest(rnd.server.setup))


def test_a_consistency_request_is_refused_in_an_unauthenticated_attempt() -> None:
    rnd = round_at(Stage.UNMASK, authenticated=False)
    cid = ids_of(12)[0]
    honest = rnd.server.request_for(cid)
    with pytest.raises(SecureAggregationError, match="no consistency stage"):
        rnd.clients[cid].handle(ConsistencyRequest(honest.round_id, honest.survivors))


def test_an_authenticated_unmask_without_confirming_first_is_out_of_order() -> None:
    rnd = round_at(Stage.CONSISTENCY, authenticated=True)
    cid = ids_of(12)[0]
    honest = rnd.server.request_for(cid)
    with pytest.raises(SecureAggregationError, match="out of order"):
        rnd.clients[cid].handle(UnmaskRequest(honest.round_id, honest.survivors))


@BOTH_MODES
def test_policy_mismatch_is_refused(authenticated: bool) -> None:
    cid = ids_of(8)[0]
    setup = make_setup(CONFIG, ids_of(8), 4, RoundId("r", 1, 0), authenticated=authenticated)
    assert setup.min_survivors == 5
    weaker = dataclasses.replace(CONFIG, threshold=5)
    with pytest.raises(SecureAggregationError, match="differ"):
        make_client(cid, authenticated=authenticated, policy=weaker).handle(
            AdvertiseKeysRequest(setup))
    stricter = dataclasses.replace(CONFIG, min_survivors=8)  # this client unmasks >= 8
    with pytest.raises(SecureAggregationError, match="requires at least 8"):
        make_client(cid, authenticated=authenticated, policy=stricter).handle(
            AdvertiseKeysRequest(setup))
    smaller = dataclasses.replace(CONFIG, max_participants=7)
    with pytest.raises(SecureAggregationError, match="max_participants"):
        make_client(cid, authenticated=authenticated, policy=smaller).handle(
            AdvertiseKeysRequest(setup))
    exactly = dataclasses.replace(CONFIG, max_participants=8)  # the bound itself is allowed
    assert isinstance(make_client(cid, authenticated=authenticated, policy=exactly).handle(
        AdvertiseKeysRequest(setup)), AdvertisedKeys)
    assert isinstance(make_client(cid, authenticated=authenticated, policy=CONFIG).handle(
        AdvertiseKeysRequest(setup)), AdvertisedKeys)


@BOTH_MODES
def test_a_stale_request_does_not_end_the_attempt_in_progress(authenticated: bool) -> None:
    ids = ids_of(8)
    inputs = make_inputs(ids, 8)
    rnd = run(setup_round(CONFIG, inputs, round_id=RoundId("run-1", 2, 5),
                          authenticated=authenticated), stop_at=Stage.SHARE_KEYS)
    client = rnd.clients[ids[0]]
    old = make_setup(CONFIG, ids, 8, RoundId("run-1", 2, 4), authenticated=authenticated)
    with pytest.raises(SecureAggregationError, match="older"):
        client.handle(AdvertiseKeysRequest(old))  # e.g. a delayed retry of attempt 4
    with pytest.raises(SecureAggregationError, match="does not match"):
        client.handle(UnmaskRequest(RoundId("run-1", 2, 4), ()))
    run(rnd)  # attempt 5 goes on and completes
    assert ids[0] in rnd.server.result.survivors


@BOTH_MODES
def test_low_order_public_key_is_refused(authenticated: bool) -> None:
    """7 clients with k = 6: everyone neighbours everyone, so a bad cipher key is always
    a neighbour's. Authenticated, its owner signed it (a colluding client): the
    signature verifies and the key itself is refused."""
    ids = ids_of(7)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 8), authenticated=authenticated),
              stop_at=Stage.SHARE_KEYS)
    request = rnd.server.request_for(ids[0])
    assert isinstance(request, ShareKeysRequest)
    owner = request.roster[1]
    bad = dataclasses.replace(owner, cipher_public_key=bytes(32))
    if authenticated:
        statement = key_statement(rnd.server.setup, owner.client_id, bytes(32),
                                  owner.mask_public_key)
        bad = dataclasses.replace(bad, signature=pki().identity(owner.client_id).sign(statement))
    with pytest.raises(SecureAggregationError, match="unusable X25519"):
        rnd.clients[ids[0]].handle(ShareKeysRequest(request.round_id,
                                                    (request.roster[0], bad,
                                                     *request.roster[2:])))
    with pytest.raises(SecureAggregationError):  # and the attempt is over
        rnd.clients[ids[0]].handle(request)


@BOTH_MODES
def test_secrets_are_erased_once_used(authenticated: bool) -> None:
    ids = ids_of(8)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 8), authenticated=authenticated),
              stop_at=Stage.MASKED_INPUT)
    attempt = rnd.clients[ids[0]]._attempt
    assert attempt is not None
    assert attempt.cipher_secrets  # kept from sealing to open the neighbours' shares
    rnd = run(rnd, stop_at=Stage.UNMASK)
    assert attempt.mask_key is None and attempt.self_mask_seed is None
    assert attempt.cipher_key is None and not attempt.cipher_secrets
    assert attempt.held  # only the neighbours' shares
    run(rnd)
    assert not attempt.held  # revealed what was asked, dropped the rest
