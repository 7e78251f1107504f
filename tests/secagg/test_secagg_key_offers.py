"""Key offers: in an unauthenticated attempt a client's share-keys reply offers keys for
its next attempt, and a server holding an unused offer skips that client's
advertise_keys stage (three round trips). Authenticated attempts never use offers: their
keys are made (and signed) after the client has seen the attempt's setup."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from secagg_driver import (
    Round,
    assert_matches_plaintext,
    exactly,
    ids_of,
    make_client,
    make_inputs,
    make_setup,
    pki,
    run,
)
from secagg_driver import setup_round as _setup_round

from fedloom.errors import MessageRejectedError, RejectReason, SecureAggregationError
from fedloom.secagg import (
    AdvertisedKeys,
    AdvertiseKeysRequest,
    KeyOffer,
    RoundId,
    SecAggConfig,
    SecAggServer,
    SecAggStatus,
    ShareKeysReply,
    ShareKeysRequest,
    Stage,
    public_bytes,
)

CONFIG = SecAggConfig(enabled=True, neighbours=6, threshold=4, clip_range=3.0, bits=20,
                      max_weight=100.0, max_participants=64)


def setup_round(*args: Any, **kwargs: Any) -> Round:
    """An unauthenticated round (the only kind that makes and uses key offers)."""
    return _setup_round(*args, authenticated=False, **kwargs)


def _second_round(first: Round, inputs: Any = None, attempt: int = 1,
                  offers: dict[str, KeyOffer] | None = None) -> Round:
    """A new attempt with the same clients and the offers of ``first``'s share replies."""
    return setup_round(CONFIG, inputs or first.inputs, round_id=RoundId("run-1", 2, attempt),
                       clients=first.clients,
                       offers=first.server.new_offers if offers is None else offers)


def _sent(rnd: Round, kind: type) -> dict[str, Any]:
    return {c: r for _, c, _, r in rnd.transcript if isinstance(r, kind)}


def test_every_share_reply_offers_fresh_keys_for_the_next_attempt() -> None:
    ids = ids_of(8)
    first = run(setup_round(CONFIG, make_inputs(ids, 8)))
    offers = first.server.new_offers
    assert sorted(offers) == ids
    advertised = _sent(first, AdvertisedKeys)
    used = {k for a in advertised.values() for k in (a.cipher_public_key, a.mask_public_key)}
    offered = {k for o in offers.values() for k in (o.cipher_public_key, o.mask_public_key)}
    assert len(offered) == 2 * len(ids) and not offered & used


def test_a_round_on_offers_skips_advertising_and_equals_the_plaintext_mean() -> None:
    ids = ids_of(10)
    first = run(setup_round(CONFIG, make_inputs(ids, 40, scale=2.0)))
    second = _second_round(first, make_inputs(ids, 40, seed=1, scale=2.0))
    assert second.server.stage is Stage.ADVERTISE_KEYS and second.server.stage_complete
    run(second)
    assert second.server.status is SecAggStatus.SUCCEEDED
    assert not any(s is Stage.ADVERTISE_KEYS for s, _, _, _ in second.transcript)
    requests = [r for s, _, r, _ in second.transcript if s is Stage.SHARE_KEYS]
    assert len(requests) == len(ids)
    for request in requests:  # the setup and the offered keys travel with share keys
        assert request.setup == second.server.setup
        offer = first.server.new_offers[request.own_keys.client_id]
        assert (request.own_keys.cipher_public_key, request.own_keys.mask_public_key) == (
            offer.cipher_public_key, offer.mask_public_key)
    assert_matches_plaintext(CONFIG, second, ids)
    # and the next attempt can run on the offers made in this one
    third = setup_round(CONFIG, make_inputs(ids, 40, seed=2), round_id=RoundId("run-1", 3, 0),
                        clients=second.clients, offers=second.server.new_offers)
    run(third)
    assert_matches_plaintext(CONFIG, third, ids)


def test_clients_without_an_offer_advertise_alongside_those_with_one() -> None:
    ids = ids_of(10)
    first = run(setup_round(CONFIG, make_inputs(ids, 16)))
    some = {c: o for c, o in first.server.new_offers.items() if c in ids[::2]}
    second = _second_round(first, offers=some)
    assert second.server.pending() == frozenset(ids[1::2])
    run(second)
    assert sorted(_sent(second, AdvertisedKeys)) == ids[1::2]
    assert_matches_plaintext(CONFIG, second, ids)


@pytest.mark.parametrize("stage", [Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASK])
def test_dropouts_in_a_round_on_offers_are_recovered(stage: Stage) -> None:
    ids = ids_of(12)
    first = run(setup_round(CONFIG, make_inputs(ids, 16)))
    gone = ids[:2]
    second = run(_second_round(first), drop_at=dict.fromkeys(gone, stage))
    survivors = ids if stage is Stage.UNMASK else ids[2:]
    assert_matches_plaintext(CONFIG, second, survivors)


def test_an_offer_is_used_for_one_attempt_only() -> None:
    ids = ids_of(8)
    first = run(setup_round(CONFIG, make_inputs(ids, 8)))
    offers = dict(first.server.new_offers)
    run(_second_round(first, attempt=1, offers=offers))
    # a server that presents the same offers again (for a retry of the round) is refused
    retry = _second_round(first, attempt=2, offers=offers)
    with pytest.raises(SecureAggregationError):
        run(retry)
    assert set(retry.refusals) == set(ids)
    assert all("not its latest offer" in why for why in retry.refusals.values())


def test_an_offer_is_gone_once_a_request_names_it_even_a_refused_one() -> None:
    ids = ids_of(8)
    first = run(setup_round(CONFIG, make_inputs(ids, 8), round_id=RoundId("run-1", 1, 3)))
    cid = ids[0]
    offer = first.server.new_offers[cid]
    older = make_setup(CONFIG, ids, 8, RoundId("run-1", 1, 2), authenticated=False)  # older than 3
    with pytest.raises(SecureAggregationError, match="already used or is older"):
        first.clients[cid].handle(ShareKeysRequest(older.round_id, (), older,
                                                   offer.advertised(older.round_id, cid)))
    fresh = make_setup(CONFIG, ids, 8, RoundId("run-1", 2, 0), authenticated=False)
    with pytest.raises(SecureAggregationError, match="never offered"):
        first.clients[cid].handle(ShareKeysRequest(fresh.round_id, (), fresh,
                                                   offer.advertised(fresh.round_id, cid)))


def test_keys_other_than_the_clients_offer_are_refused() -> None:
    ids = ids_of(8)
    first = run(setup_round(CONFIG, make_inputs(ids, 8)))
    offers = first.server.new_offers
    second = _second_round(first)
    run(second, stop_at=Stage.SHARE_KEYS)
    request = second.server.request_for(ids[0])
    assert isinstance(request, ShareKeysRequest) and request.own_keys is not None
    forged = offers[ids[1]].advertised(request.round_id, ids[0])  # a neighbour's keys
    with pytest.raises(SecureAggregationError, match="not its latest offer"):
        first.clients[ids[0]].handle(dataclasses.replace(request, own_keys=forged))
    # the offer is used up by that request: the honest one is refused as well
    why = ("client 'client-000' refuses: the server presents keys this client never offered "
           "(or offered for an attempt that already used them)")
    with pytest.raises(SecureAggregationError, match=exactly(why)):
        first.clients[ids[0]].handle(request)


def test_only_the_latest_offer_is_kept() -> None:
    ids = ids_of(8)
    first = run(setup_round(CONFIG, make_inputs(ids, 8)))
    offers = dict(first.server.new_offers)
    second = run(setup_round(CONFIG, first.inputs, round_id=RoundId("run-1", 2, 0),
                             clients=first.clients))  # advertised afresh: new offers made
    assert offers[ids[0]] != second.server.new_offers[ids[0]]
    with pytest.raises(SecureAggregationError):
        run(_second_round(first, attempt=5, offers=offers))


def test_an_advertise_request_for_an_attempt_begun_on_an_offer_is_refused() -> None:
    ids = ids_of(8)
    first = run(setup_round(CONFIG, make_inputs(ids, 8)))
    second = run(_second_round(first), stop_at=Stage.MASKED_INPUT)
    with pytest.raises(SecureAggregationError, match="second, different advertise_keys"):
        first.clients[ids[0]].handle(AdvertiseKeysRequest(second.server.setup))


def test_a_repeated_share_request_on_an_offer_gets_the_same_reply() -> None:
    ids = ids_of(8)
    first = run(setup_round(CONFIG, make_inputs(ids, 8)))
    second = run(_second_round(first), stop_at=Stage.SHARE_KEYS)
    request = second.server.request_for(ids[0])
    client = first.clients[ids[0]]
    reply = client.handle(request)
    assert isinstance(reply, ShareKeysReply)
    assert client.handle(request) is reply  # a transport retry reveals nothing new
    other = dataclasses.replace(request, setup=dataclasses.replace(
        request.setup, model_digest=b"\1" * 32))
    with pytest.raises(SecureAggregationError, match="differ"):
        client.handle(other)


def test_the_server_refuses_offers_that_repeat_keys() -> None:
    ids = ids_of(8)
    first = run(setup_round(CONFIG, make_inputs(ids, 8)))
    offers = dict(first.server.new_offers)
    offers[ids[1]] = offers[ids[0]]  # one key pair offered twice: the second advertises
    second = _second_round(first, offers=offers)
    assert second.server.pending() == frozenset({ids[1]})
    run(second, stop_at=Stage.SHARE_KEYS)
    request = second.server.request_for(ids[2])
    assert isinstance(request, ShareKeysRequest)
    reply = first.clients[ids[2]].handle(request)
    assert isinstance(reply, ShareKeysReply) and reply.next_keys is not None
    own = request.own_keys
    assert own is not None
    stale = KeyOffer(own.cipher_public_key, reply.next_keys.mask_public_key)
    with pytest.raises(MessageRejectedError, match="not fresh") as info:
        second.server.receive(ids[2], dataclasses.replace(reply, next_keys=stale))
    assert info.value.reason is RejectReason.INVALID


def test_a_client_may_make_no_offers() -> None:
    ids = ids_of(8)
    clients = {c: make_client(c, i, authenticated=False, offer_keys=i % 2 == 0)
               for i, c in enumerate(ids)}
    first = run(setup_round(CONFIG, make_inputs(ids, 8), clients=clients))
    assert sorted(first.server.new_offers) == ids[::2]
    second = run(_second_round(first))
    assert sorted(_sent(second, AdvertisedKeys)) == ids[1::2]
    assert_matches_plaintext(CONFIG, second, ids)


def test_offered_keys_are_the_attempts_keys_and_are_erased_after_use() -> None:
    ids = ids_of(8)
    first = run(setup_round(CONFIG, make_inputs(ids, 8)))
    offer = first.server.new_offers[ids[0]]
    second = run(_second_round(first), stop_at=Stage.MASKED_INPUT)
    attempt = first.clients[ids[0]]._attempt
    assert attempt is not None and attempt.mask_key is not None
    assert public_bytes(attempt.mask_key) == offer.mask_public_key
    run(second)
    assert attempt.mask_key is None and attempt.cipher_key is None


# -- authenticated attempts never use offers ------------------------------------------


def test_authenticated_clients_make_no_offers() -> None:
    ids = ids_of(8)
    rnd = run(_setup_round(CONFIG, make_inputs(ids, 8)))
    assert rnd.server.setup.authenticated
    assert rnd.server.new_offers == {}
    replies = [r for _, _, _, r in rnd.transcript if isinstance(r, ShareKeysReply)]
    assert len(replies) == 8 and all(r.next_keys is None for r in replies)


def test_an_authenticated_server_takes_no_offers() -> None:
    ids = ids_of(8)
    first = run(setup_round(CONFIG, make_inputs(ids, 8)))
    setup = make_setup(CONFIG, ids, 8, RoundId("run-1", 2, 0))
    with pytest.raises(SecureAggregationError, match="never uses key offers"):
        SecAggServer(setup, offers=first.server.new_offers, verifier=pki().verifier)
    # nor an offer in a share-keys reply of an authenticated attempt
    rnd = run(_setup_round(CONFIG, make_inputs(ids, 8)), stop_at=Stage.SHARE_KEYS)
    reply = rnd.clients[ids[0]].handle(rnd.server.request_for(ids[0]))
    assert isinstance(reply, ShareKeysReply)
    offered = dataclasses.replace(reply, next_keys=first.server.new_offers[ids[0]])
    with pytest.raises(MessageRejectedError, match="key offer in an authenticated") as info:
        rnd.server.receive(ids[0], offered)
    assert info.value.reason is RejectReason.INVALID
    rnd.server.receive(ids[0], reply)  # the reply without it is taken


def test_a_client_refuses_to_begin_an_authenticated_attempt_on_an_offer() -> None:
    """An unauthenticated client (no certificate) that offered keys, and an authenticated
    setup presenting them: refused, and the offer is used up."""
    ids = ids_of(8)
    first = run(setup_round(CONFIG, make_inputs(ids, 8)))
    cid = ids[0]
    offer = first.server.new_offers[cid]
    signed = make_setup(CONFIG, ids, 8, RoundId("run-1", 2, 0))
    why = ("client 'client-000' refuses: an authenticated round never uses key offers: its "
           "keys must be made after the setup is known")
    with pytest.raises(SecureAggregationError, match=exactly(why)):
        first.clients[cid].handle(ShareKeysRequest(signed.round_id, (), signed,
                                                   offer.advertised(signed.round_id, cid)))
    fresh = make_setup(CONFIG, ids, 8, RoundId("run-1", 2, 1), authenticated=False)
    with pytest.raises(SecureAggregationError, match="never offered"):
        first.clients[cid].handle(ShareKeysRequest(fresh.round_id, (), fresh,
                                                   offer.advertised(fresh.round_id, cid)))
