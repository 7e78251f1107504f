"""A client's edge cases: how it is called (the generator it rounds with, what
masked_input needs, what is not a request), the keys and setup a share-keys request
presents, caller-encoded inputs, rosters and survivor sets at their limits, and the
exact refusal each of these gets."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, TypeVar

import numpy as np
import pytest
from clients_defend_support import CONFIG, round_at
from secagg_driver import (
    Round,
    assert_matches_plaintext,
    exactly,
    fresh_keys,
    ids_of,
    make_client,
    make_inputs,
    make_setup,
    pki,
    refusal,
    run,
    setup_round,
)

import fedloom.secagg._client as client_module
from fedloom.errors import SecureAggregationError
from fedloom.secagg import (
    AdvertisedKeys,
    Confirmation,
    ConsistencyRequest,
    MaskedInputReply,
    MaskedInputRequest,
    SecAggClient,
    SecAggConfig,
    ShareKeysReply,
    ShareKeysRequest,
    Stage,
    UnmaskRequest,
    key_statement,
    quantize,
)

_Q = TypeVar("_Q")


def _request(rnd: Round, cid: str, kind: type[_Q]) -> _Q:
    """The honest server's current request for ``cid``, of the stage's ``kind``."""
    request = rnd.server.request_for(cid)
    assert isinstance(request, kind)
    return request


# -- how a client is called ------------------------------------------------------------


def test_a_client_rounds_with_the_generator_it_was_given() -> None:
    """The masks cancel, so the unmasked total is the sum of the clients' quantized
    inputs: each client's stochastic rounding comes from the generator it was given
    (the driver seeds client i's generator with i)."""
    ids = ids_of(8)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 16), authenticated=False))
    setup = rnd.server.setup
    expected = np.zeros(setup.masked_length, np.uint64)
    for i, cid in enumerate(sorted(ids)):
        vector, n = rnd.inputs[cid]
        expected += quantize(vector, setup.config().weight_of(n), setup.clip_range,
                             setup.bits, np.random.default_rng(i))
    total = rnd.server.result.total
    assert total.dtype == np.uint32
    assert np.array_equal(total, (expected % (1 << 32)).astype(np.uint32))


def test_a_client_given_no_generator_rounds_with_one_of_its_own() -> None:
    ids = ids_of(8)
    clients = {cid: SecAggClient(cid) for cid in ids}
    rnd = run(setup_round(CONFIG, make_inputs(ids, 16), clients=clients, authenticated=False))
    assert_matches_plaintext(CONFIG, rnd, ids)


def test_masked_input_needs_both_the_vector_and_the_example_count() -> None:
    """Refused before the stage runs: the attempt goes on and the full call is answered."""
    rnd = round_at(Stage.MASKED_INPUT, authenticated=False)
    cid = ids_of(12)[0]
    client, request = rnd.clients[cid], _request(rnd, cid, MaskedInputRequest)
    vector, n = rnd.inputs[cid]
    partials: list[dict[str, Any]] = [{"num_examples": n}, {"vector": vector}]
    for partial in partials:
        with pytest.raises(SecureAggregationError,
                           match=exactly("masked_input needs the vector and num_examples")):
            client.handle(request, **partial)
    assert isinstance(client.handle(request, vector=vector, num_examples=n), MaskedInputReply)


def test_a_message_that_is_not_a_request_is_refused_by_its_type() -> None:
    ids = ids_of(8)
    client = make_client(ids[0], authenticated=False)
    keys = AdvertisedKeys(make_setup(CONFIG, ids, 8, authenticated=False).round_id, ids[0],
                          *fresh_keys())
    with pytest.raises(SecureAggregationError,
                       match=exactly("not a SecAgg+ request: AdvertisedKeys")):
        client.handle(keys)  # type: ignore[arg-type]


# -- what a share-keys request presents ------------------------------------------------


def test_a_fresh_client_refuses_keys_it_never_offered() -> None:
    ids = ids_of(8)
    client = make_client(ids[0], authenticated=False)
    setup = make_setup(CONFIG, ids, 8, authenticated=False)
    presented = AdvertisedKeys(setup.round_id, ids[0], *fresh_keys())
    why = ("the server presents keys this client never offered (or offered for an attempt "
           "that already used them)")
    with pytest.raises(SecureAggregationError, match=refusal(ids[0], why)):
        client.handle(ShareKeysRequest(setup.round_id, (), setup, presented))


def _own(request: ShareKeysRequest, cid: str) -> AdvertisedKeys:
    return next(k for k in request.roster if k.client_id == cid)


def test_a_share_request_whose_setup_differs_from_the_attempts_is_refused() -> None:
    rnd = round_at(Stage.SHARE_KEYS, authenticated=False, n=8)
    cid = ids_of(8)[0]
    honest = _request(rnd, cid, ShareKeysRequest)
    other = dataclasses.replace(rnd.server.setup,
                                model_digest=hashlib.sha256(b"another model").digest())
    request = ShareKeysRequest(honest.round_id, honest.roster, other, _own(honest, cid))
    with pytest.raises(SecureAggregationError,
                       match=refusal(cid, "the share-keys request's setup differs from this "
                                           "attempt's")):
        rnd.clients[cid].handle(request)


def test_keys_presented_as_the_clients_own_must_be_its_own() -> None:
    """A share-keys request may repeat the setup and the client's own keys (as on a key
    offer): those keys must be the ones this client advertised, under its own id."""
    rnd = round_at(Stage.SHARE_KEYS, authenticated=False, n=8)
    ids, setup = ids_of(8), rnd.server.setup
    cases = {
        ids[0]: lambda mine: mine,
        ids[1]: lambda mine: dataclasses.replace(mine, client_id=ids[2]),  # its keys, not id
        ids[2]: lambda mine: dataclasses.replace(mine, cipher_public_key=fresh_keys()[0]),
    }
    for cid, present in cases.items():
        honest = _request(rnd, cid, ShareKeysRequest)
        request = ShareKeysRequest(honest.round_id, honest.roster, setup,
                                   present(_own(honest, cid)))
        if cid == ids[0]:
            assert isinstance(rnd.clients[cid].handle(request), ShareKeysReply)
            continue
        with pytest.raises(SecureAggregationError, match=refusal(
                cid, "the keys the server presents as this client's are not its own")):
            rnd.clients[cid].handle(request)


def test_a_graph_that_gives_fewer_than_t_neighbours_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The roster check makes the graph give every member at least t neighbours; should
    a graph give fewer, the client still refuses to share its secrets among them."""
    rnd = round_at(Stage.SHARE_KEYS, authenticated=True, n=8)
    cid, t = ids_of(8)[0], CONFIG.threshold
    derive = client_module.neighbour_graph

    def trimmed(*args: Any) -> dict[str, frozenset[str]]:
        graph = dict(derive(*args))
        graph[cid] = frozenset(sorted(graph[cid])[: t - 1])
        return graph

    monkeypatch.setattr(client_module, "neighbour_graph", trimmed)
    why = f"only {t - 1} neighbours advertised keys; at least the threshold ({t}) is needed " \
          "to share secrets"
    with pytest.raises(SecureAggregationError, match=refusal(cid, why)):
        rnd.clients[cid].handle(_request(rnd, cid, ShareKeysRequest))


# -- inputs the caller encoded itself ----------------------------------------------------


def test_a_caller_encoded_input_is_masked_as_it_is() -> None:
    """uint32 vectors of masked_length (the distributed-DP encoding) are masked without
    quantizing: the unmasked total is their sum modulo 2**32. Each reply's vector is
    read-only (a retry returns it again) and the caller's array is left as it was."""
    ids = ids_of(8)
    rnd = setup_round(CONFIG, make_inputs(ids, 8), authenticated=False)
    length = rnd.server.setup.masked_length
    rng = np.random.default_rng(5)
    encoded = {}
    for cid in ids:
        vector = rng.integers(0, 1 << 32, length, dtype=np.uint32)
        vector[-1] = 1  # the count of contributors, as the encoding has it
        encoded[cid] = vector
        rnd.inputs[cid] = (vector, rnd.inputs[cid][1])
    kept = {cid: v.copy() for cid, v in encoded.items()}
    run(rnd)
    total = np.sum([v.astype(np.uint64) for v in encoded.values()], axis=0)
    assert np.array_equal(rnd.server.result.total, (total % (1 << 32)).astype(np.uint32))
    assert all(np.array_equal(encoded[c], kept[c]) for c in ids)
    replies = [r for _, _, _, r in rnd.transcript if isinstance(r, MaskedInputReply)]
    assert len(replies) == len(ids)
    for reply in replies:
        assert not reply.masked.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            reply.masked[0] = 0


def test_inputs_of_the_wrong_shape_are_refused() -> None:
    rnd = round_at(Stage.MASKED_INPUT, authenticated=False)
    ids, setup = ids_of(12), rnd.server.setup
    d, m = setup.vector_length, setup.masked_length
    cases: list[tuple[str, np.ndarray, str]] = [
        (ids[0], np.zeros(d, np.uint32),
         f"the encoded input has shape ({d},); the round expects ({m},)"),
        (ids[1], np.zeros(m), f"the update has shape ({m},); the round expects ({d},)")]
    for cid, vector, why in cases:
        with pytest.raises(SecureAggregationError, match=refusal(cid, why)):
            rnd.clients[cid].handle(_request(rnd, cid, MaskedInputRequest), vector=vector,
                                    num_examples=5)


# -- unmask requests ------------------------------------------------------------------


def test_an_unmask_request_for_another_set_than_the_confirmed_one_is_refused() -> None:
    rnd = round_at(Stage.UNMASK, authenticated=True)
    cid = ids_of(12)[0]
    honest = _request(rnd, cid, UnmaskRequest)
    fewer = tuple(c for c in honest.survivors if c != honest.survivors[-1])
    why = "the unmask request names another survivor set than the one this client confirmed"
    with pytest.raises(SecureAggregationError, match=refusal(cid, why)):
        rnd.clients[cid].handle(UnmaskRequest(honest.round_id, fewer, honest.confirmations))


def test_an_unauthenticated_unmask_request_with_confirmations_is_refused() -> None:
    rnd = round_at(Stage.UNMASK, authenticated=False)
    cid = ids_of(12)[0]
    honest = _request(rnd, cid, UnmaskRequest)
    signer = min(rnd.server.graph[cid])
    request = UnmaskRequest(honest.round_id, honest.survivors, (Confirmation(signer, b"sig"),))
    with pytest.raises(SecureAggregationError,
                       match=refusal(cid, "an unauthenticated round carries confirmations")):
        rnd.clients[cid].handle(request)


# -- rosters ----------------------------------------------------------------------------


def test_an_unauthenticated_roster_with_signed_keys_is_refused() -> None:
    rnd = round_at(Stage.SHARE_KEYS, authenticated=False, n=8)
    cid = ids_of(8)[0]
    honest = _request(rnd, cid, ShareKeysRequest)
    roster = list(honest.roster)
    other = roster[1]
    identity = pki().identity(other.client_id)
    signature = identity.sign(key_statement(rnd.server.setup, other.client_id,
                                            other.cipher_public_key, other.mask_public_key))
    roster[1] = dataclasses.replace(other, certificate=identity.certificate_der,
                                    signature=signature)
    with pytest.raises(SecureAggregationError,
                       match=refusal(cid, "an unauthenticated round carries signed keys")):
        rnd.clients[cid].handle(ShareKeysRequest(honest.round_id, tuple(roster)))


def test_a_roster_needs_threshold_plus_one_participants() -> None:
    """Unauthenticated, a roster may leave out clients that did not advertise, but t + 1
    must remain (each member then has t neighbours to share with)."""
    rnd = round_at(Stage.SHARE_KEYS, authenticated=False, n=8)
    ids, t = ids_of(8), CONFIG.threshold

    def first(request: ShareKeysRequest, count: int) -> ShareKeysRequest:
        return ShareKeysRequest(request.round_id, request.roster[:count])

    short = first(_request(rnd, ids[0], ShareKeysRequest), t)
    why = f"only {t} participants advertised keys; at least threshold + 1 = {t + 1} are needed"
    with pytest.raises(SecureAggregationError, match=refusal(ids[0], why)):
        rnd.clients[ids[0]].handle(short)
    enough = first(_request(rnd, ids[1], ShareKeysRequest), t + 1)
    reply = rnd.clients[ids[1]].handle(enough)
    assert isinstance(reply, ShareKeysReply)
    assert {s.receiver for s in reply.shares} == set(ids[: t + 1]) - {ids[1]}


def test_a_roster_leaving_out_many_participants_names_the_first_five() -> None:
    rnd = round_at(Stage.SHARE_KEYS, authenticated=True, n=14)
    ids = ids_of(14)
    cid = ids[0]
    honest = _request(rnd, cid, ShareKeysRequest)
    short = ShareKeysRequest(honest.round_id, honest.roster[:7])  # ids[7:] left out
    why = (f"the roster leaves out 7 participants ({ids[7:12]}): in an authenticated round "
           "every participant's keys shape the graph, so the server must start a new "
           "attempt without them rather than choose which keys count")
    with pytest.raises(SecureAggregationError, match=refusal(cid, why)):
        rnd.clients[cid].handle(short)


# -- survivor sets --------------------------------------------------------------------


def test_a_survivor_set_naming_many_strangers_names_the_first_five() -> None:
    rnd = round_at(Stage.CONSISTENCY, authenticated=True)
    cid = ids_of(12)[0]
    honest = _request(rnd, cid, ConsistencyRequest)
    strangers = [f"zz-stranger-{i}" for i in range(7)]
    survivors = tuple(sorted([*honest.survivors, *strangers]))
    why = f"the survivor set names {strangers[:5]}, which advertised no keys in this attempt"
    with pytest.raises(SecureAggregationError, match=refusal(cid, why)):
        rnd.clients[cid].handle(ConsistencyRequest(honest.round_id, survivors))


K14 = SecAggConfig(enabled=True, neighbours=14, threshold=8, clip_range=3.0, bits=20,
                   max_weight=100.0, max_participants=64)


def test_a_survivor_set_naming_many_withheld_neighbours_names_the_first_five() -> None:
    """k = 14, t = 8: the server delivers 8 of the target's 14 neighbours' shares (enough
    to mask), then names all 14 among the survivors."""
    ids = ids_of(16)
    target = ids[3]
    kept: list[str] = []

    def withhold(stage: Stage, cid: str, request: Any) -> Any:
        if stage is Stage.MASKED_INPUT and cid == target:
            kept.extend(s.sender for s in request.shares[: K14.threshold])
            return MaskedInputRequest(request.round_id, request.shares[: K14.threshold],
                                      request.commitments[: K14.threshold])
        return request

    rnd = run(setup_round(K14, make_inputs(ids, 4), authenticated=False),
              tamper_request=withhold, stop_at=Stage.UNMASK)
    withheld = sorted(rnd.server.graph[target] - set(kept))
    assert len(withheld) == 6 and target in rnd.server.survivors
    why = (f"the survivor set names the neighbours {withheld[:5]}, whose shares the server "
           "never delivered to this client (a server that withholds shares could isolate a "
           "small group)")
    with pytest.raises(SecureAggregationError, match=refusal(target, why)):
        rnd.clients[target].handle(_request(rnd, target, UnmaskRequest))
