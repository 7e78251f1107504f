"""A malicious server forges, replays and repeats: confirmations, keys, shares, requests.

Threat model: the server is the adversary. It holds every message of earlier attempts
and may replay any of it into a new one, fabricate or re-attribute confirmations, send
a second, different request in one stage, and corrupt what a client reveals.
`MaliciousServer` (and, for the honest-server checks, the in-process driver) runs real
`SecAggClient` objects.

This module shows: forged, re-attributed, foreign and too few confirmations are refused;
keys, sealed shares, confirmations and requests of an earlier attempt are refused and
do not disturb the attempt in progress; a client answers each stage once (an identical
retry gets the identical reply, a different request is refused); the honest server
rejects a corrupted share and still finishes with the right mean, and a holder refuses
a dealer whose shares do not match its commitments; after any refusal the client holds
nothing of the attempt. The last test documents a leak across attempts that the clients
do not prevent (see its reason).
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
from malicious_server import MaliciousServer, build
from secagg_driver import (
    assert_matches_plaintext,
    ids_of,
    make_client,
    make_inputs,
    pki,
    run,
    setup_round,
)

from fedloom import certs
from fedloom.errors import SecureAggregationError
from fedloom.secagg import (
    PRIME,
    SHARE_BYTES,
    AdvertiseKeysRequest,
    Confirmation,
    ConsistencyRequest,
    EncryptedShare,
    MaskedInputReply,
    MaskedInputRequest,
    RevealedShare,
    RoundId,
    RoundLedger,
    SecAggConfig,
    SecAggStatus,
    ShareKeysRequest,
    SigningIdentity,
    Stage,
    UnmaskRequest,
    survivors_statement,
)

K6 = SecAggConfig(enabled=True, neighbours=6, threshold=4, clip_range=2.0, bits=20,
                  max_weight=100.0, max_participants=64)
K10 = SecAggConfig(enabled=True, neighbours=10, threshold=6, clip_range=2.0, bits=20,
                   max_weight=100.0, max_participants=64)
N = 12


def _attempt(number: int, server: MaliciousServer | None = None,
             n: int = N) -> MaliciousServer:
    """Attempt ``number`` of round 1, over the clients of ``server`` (fresh ones if None)."""
    return build(K6, n, round_id=RoundId("run-1", 1, number),
                 clients=server.clients if server else None)


def _confirmed(server: MaliciousServer) -> tuple[str, ...]:
    """Run to the end of consistency, every client shown (and confirming) every client."""
    server.run_to_masked_input()
    everyone = tuple(sorted(server.clients))
    server.consistency(dict.fromkeys(everyone, everyone))
    assert server.refusals == {}
    return everyone


# -- forged confirmations -------------------------------------------------------------


FORGERIES = {
    "another_set": "does not verify: it did not sign this survivor set for this attempt and "
                   "roster",
    "another_attempt": "does not verify: it did not sign this survivor set for this attempt "
                       "and roster",
    "server_key": "does not verify: it did not sign this survivor set for this attempt and "
                  "roster",
    "swapped_signers": "does not verify: it did not sign this survivor set for this attempt "
                       "and roster",
    "non_neighbour": "which is not a surviving neighbour",
    "too_few": "refuses: only 3 neighbours confirmed the survivor set; at least the threshold "
               "(4) must, before any share is revealed",
}


def _forge(forgery: str, server: MaliciousServer, first: MaliciousServer, cid: str,
           x: str, everyone: tuple[str, ...]) -> list[Confirmation]:
    honest = list(server.confirmations_for(cid, everyone))
    if forgery == "another_set":  # x's genuine signature, of the other set it was shown
        return [*honest, Confirmation(x, server.signed[x][1])]
    if forgery == "another_attempt":  # x's genuine signature of this set, attempt 1
        return [*honest, Confirmation(x, first.signed[x][1])]
    if forgery == "server_key":  # signed with the server's own (CA-issued) key
        issued = certs.make_server_cert(pki().ca)
        signature = SigningIdentity(issued.cert, issued.key).sign(
            survivors_statement(server.setup, everyone, graph_seed=server.seed_of(cid)))
        return [*honest, Confirmation(x, signature)]
    if forgery == "swapped_signers":
        a, b = honest[0], honest[1]
        return [Confirmation(a.signer, b.signature), Confirmation(b.signer, a.signature),
                *honest[2:]]
    if forgery == "non_neighbour":  # a genuine confirmation of this set by a non-neighbour
        z = next(c for c in everyone if c != cid and c not in server.graph[cid])
        return [*honest, Confirmation(z, server.signed[z][1])]
    assert forgery == "too_few"
    return honest[: server.setup.threshold - 1]


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_forged_confirmations_are_refused(forgery: str) -> None:
    first = _attempt(1)
    _confirmed(first)
    server = _attempt(2, first)
    server.run_to_masked_input()
    everyone = tuple(sorted(server.clients))
    cid = everyone[0]
    x = min(server.graph[cid])  # a neighbour of cid, shown (and confirming) another set
    far = next(c for c in everyone if c != x and c not in server.graph[x])
    views = dict.fromkeys(everyone, everyone)
    views[x] = tuple(c for c in everyone if c != far)
    server.consistency(views)
    assert server.refusals == {}
    honest = UnmaskRequest(server.setup.round_id, everyone,
                           server.confirmations_for(cid, everyone))
    assert len(honest.confirmations) == K6.neighbours - 1  # all but x: enough
    forged = _forge(forgery, server, first, cid, x, everyone)
    request = UnmaskRequest(server.setup.round_id, everyone,
                            tuple(sorted(forged, key=lambda c: c.signer)))
    assert server.send_unmask(cid, request) is None
    assert FORGERIES[forgery] in server.refusals[cid]
    # nothing was revealed, and nothing is left to reveal
    assert server.clients[cid].setup is None
    assert server.send_unmask(cid, honest) is None
    assert "does not match this client's current round attempt" in server.refusals[cid]


# -- replays of an earlier attempt ---------------------------------------------------


@pytest.mark.parametrize("relabelled", [False, True], ids=["as_sent", "relabelled"])
def test_signed_keys_of_an_earlier_attempt_are_refused(relabelled: bool) -> None:
    first = _attempt(1)
    first.advertise()
    server = _attempt(2, first)
    server.advertise()
    everyone = sorted(server.clients)
    victim, other = everyone[0], everyone[4]
    old = first.keys[other]
    if relabelled:  # the server rewrites the attempt the keys name
        old = dataclasses.replace(old, round_id=server.setup.round_id)
    roster = tuple(old if k.client_id == other else k for k in server.full_roster())
    server.share_keys({victim: roster})
    what = "does not verify" if relabelled else "are for another round attempt"
    assert f"keys of {other!r}" in server.refusals[victim]
    assert what in server.refusals[victim]
    assert server.clients[victim].setup is None


def test_sealed_shares_of_an_earlier_attempt_are_refused() -> None:
    # 7 clients with k = 6: every pair neighbours in both attempts
    first = _attempt(1, n=7)
    first.advertise()
    first.share_keys()
    server = _attempt(2, first, n=7)
    server.advertise()
    server.share_keys()
    everyone = sorted(server.clients)
    victim, sender = everyone[0], everyone[1]
    current, old = server.inbox_for(victim), first.inbox_for(victim)
    i = [s.sender for s in current.shares].index(sender)
    j = [s.sender for s in old.shares].index(sender)
    shares, commitments = list(current.shares), list(current.commitments)
    shares[i], commitments[i] = old.shares[j], old.commitments[j]
    server.send_masked_input(victim, MaskedInputRequest(server.setup.round_id, tuple(shares),
                                                        tuple(commitments)))
    assert f"the share from {sender!r} to {victim!r} failed authentication" in \
        server.refusals[victim]
    assert server.clients[victim].setup is None


def test_requests_of_an_earlier_attempt_are_refused_and_leave_the_current_one() -> None:
    first = _attempt(1)
    everyone = _confirmed(first)
    cid = everyone[0]
    old_unmask = UnmaskRequest(first.setup.round_id, everyone,
                               first.confirmations_for(cid, everyone))
    server = _attempt(2, first)
    _confirmed(server)
    assert server.send(cid, old_unmask) is None
    assert "does not match this client's current round attempt" in server.refusals[cid]
    assert server.send(cid, AdvertiseKeysRequest(first.setup)) is None
    assert "already used or is older" in server.refusals[cid]
    assert server.clients[cid].setup == server.setup  # attempt 2 goes on
    server.unmask({cid: everyone})
    assert cid in server.unmasked


def test_each_stage_is_answered_once_and_a_retry_reveals_nothing_new() -> None:
    server = _attempt(1)
    server.run_to_masked_input()
    everyone = tuple(sorted(server.clients))
    rid, cid, other = server.setup.round_id, everyone[0], everyone[1]
    # masked input: the same request again gets the same vector (no fresh rounding) ...
    again = server.send(cid, server.inbox_for(cid))
    assert isinstance(again, MaskedInputReply)
    assert np.array_equal(again.masked, server.masked[cid])
    # ... a different one is refused
    fewer = server.inbox_for(cid, withhold={(min(server.graph[cid]), cid)})
    assert server.send(cid, fewer) is None
    assert "a second, different masked_input request" in server.refusals[cid]
    # consistency: one survivor set per client
    server.consistency(dict.fromkeys(everyone, everyone))
    far = next(c for c in everyone if c != other and c not in server.graph[other])
    second = ConsistencyRequest(rid, tuple(c for c in everyone if c != far))
    assert server.send(other, second) is None
    assert "a second, different consistency request" in server.refusals[other]
    assert server.clients[other].setup is None
    # unmask: an identical retry gets the identical reply, a different request nothing
    third = everyone[2]
    request = UnmaskRequest(rid, everyone, server.confirmations_for(third, everyone))
    reply = server.send_unmask(third, request)
    assert reply is not None and server.send_unmask(third, request) == reply
    trimmed = UnmaskRequest(rid, everyone, request.confirmations[: K6.threshold])
    assert server.send_unmask(third, trimmed) is None
    assert "a second, different unmask request" in server.refusals[third]


# -- corrupted shares -----------------------------------------------------------------


def test_a_corrupted_revealed_share_is_rejected_and_the_round_still_finishes() -> None:
    ids = ids_of(16)
    rnd = setup_round(K10, make_inputs(ids, 50))
    liar = ids[2]

    def corrupt(stage: Stage, cid: str, reply: object) -> object:
        if stage is Stage.UNMASK and cid == liar:
            assert hasattr(reply, "self_mask_shares")
            first, *rest = reply.self_mask_shares
            value = (int.from_bytes(first.value, "big") + 1) % PRIME
            return dataclasses.replace(reply, self_mask_shares=(
                RevealedShare(first.owner, value.to_bytes(SHARE_BYTES, "big")), *rest))
        return reply

    run(rnd, tamper_reply=corrupt)
    assert "does not match the commitment its owner published" in rnd.rejections[liar]
    assert set(rnd.rejections) == {liar}
    assert rnd.server.status is SecAggStatus.SUCCEEDED
    assert_matches_plaintext(K10, rnd, ids)  # the liar's input is in the sum all the same


def test_a_dealer_whose_shares_do_not_match_its_commitments_is_refused() -> None:
    ids = ids_of(16)
    rnd = setup_round(K10, make_inputs(ids, 50))
    dealer, holders = ids[4], []

    def corrupt(stage: Stage, cid: str, reply: object) -> object:
        if stage is Stage.SHARE_KEYS and cid == dealer:
            assert hasattr(reply, "share_commitments")
            first, *rest = reply.share_commitments
            holders.append(first.holder)
            bad = dataclasses.replace(first, mask_key=hashlib.sha256(b"other").digest())
            return dataclasses.replace(reply, share_commitments=(bad, *rest))
        return reply

    run(rnd, tamper_reply=corrupt)
    holder = holders[0]
    assert f"the shares from {dealer!r} do not match the commitments" in rnd.refusals[holder]
    assert_matches_plaintext(K10, rnd, [c for c in ids if c != holder])


# -- secrets do not outlive a refusal -------------------------------------------------


def _flipped(request: MaskedInputRequest) -> MaskedInputRequest:
    share = request.shares[0]
    broken = EncryptedShare(share.sender, share.receiver, share.nonce,
                            bytes([share.ciphertext[0] ^ 1]) + share.ciphertext[1:])
    return dataclasses.replace(request, shares=(broken, *request.shares[1:]))


@pytest.mark.parametrize("stage", ["share_keys", "masked_input", "consistency", "unmask"])
def test_a_refusal_ends_the_attempt_and_drops_its_secrets(stage: str) -> None:
    server = _attempt(1)
    server.advertise()
    everyone = tuple(sorted(server.clients))
    rid, cid = server.setup.round_id, everyone[0]
    if stage == "share_keys":
        honest = ShareKeysRequest(rid, server.full_roster())
        bad = ShareKeysRequest(rid, server.full_roster()[:-1])
    else:
        server.share_keys()
        if stage == "masked_input":
            honest = server.inbox_for(cid)
            bad = _flipped(honest)
        else:
            server.masked_input()
            if stage == "consistency":
                honest = ConsistencyRequest(rid, everyone)
                bad = ConsistencyRequest(rid, everyone[1:])
            else:
                server.consistency(dict.fromkeys(everyone, everyone))
                honest = UnmaskRequest(rid, everyone, server.confirmations_for(cid, everyone))
                bad = UnmaskRequest(rid, everyone, honest.confirmations[: K6.threshold - 1])
    assert server.send(cid, bad) is None
    client = server.clients[cid]
    assert client.setup is None and client._attempt is None  # keys, seed, shares: gone
    assert server.send(cid, honest) is None
    assert "does not match this client's current round attempt" in server.refusals[cid]


# -- across attempts ------------------------------------------------------------------


def test_two_attempts_that_differ_by_one_client_do_not_reveal_it() -> None:
    """A server completes attempt 1 over every client, then claims it failed and starts
    attempt 2 of the same round without the victim: the difference of the two sums would
    be the victim's update (a retried attempt masks the same update). A client that
    revealed shares in a round takes part in no other attempt of it, so attempt 2 never
    gets started, and the second sum does not exist."""
    ids = ids_of(N)
    victim = ids[0]
    inputs = make_inputs(ids, 50)
    clients = {c: make_client(c, i) for i, c in enumerate(ids)}
    first = run(setup_round(K6, inputs, RoundId("run-1", 1, 1), clients))
    assert first.server.status is SecAggStatus.SUCCEEDED
    rest = {c: inputs[c] for c in ids if c != victim}
    second = setup_round(K6, rest, RoundId("run-1", 1, 2), {c: clients[c] for c in rest})
    with pytest.raises(SecureAggregationError):
        run(second)
    assert second.server.status is SecAggStatus.FAILED
    refused = set(second.refusals)
    revealed = set(first.server.revealed)
    assert revealed and revealed - {victim} <= refused
    assert all("may be in the sum of an earlier attempt of round 1" in second.refusals[c]
               for c in revealed - {victim})
    # the same clients take part in the next round as usual
    third = run(setup_round(K6, rest, RoundId("run-1", 2, 3), {c: clients[c] for c in rest}))
    assert third.server.status is SecAggStatus.SUCCEEDED


def test_ending_the_session_does_not_make_a_client_forget_the_round() -> None:
    """The same attack with a twist: after attempt 1 the server ends every session, so
    the clients join again under new ids (new `SecAggClient` objects). They keep one
    `RoundLedger` across their sessions (`ClientRunner` does), so they still refuse a
    second attempt of round 1. (Unauthenticated, so that the new session ids need no
    certificates of their own; the ledger is checked before anything else.)"""
    ids = ids_of(N)
    inputs = make_inputs(ids, 50)
    ledgers = {c: RoundLedger() for c in ids}
    first = run(setup_round(K6, inputs, RoundId("run-1", 1, 1),
                            {c: make_client(c, i, authenticated=False, ledger=ledgers[c])
                             for i, c in enumerate(ids)}, authenticated=False))
    assert first.server.status is SecAggStatus.SUCCEEDED
    rejoined = {f"{c}-again": c for c in ids[1:]}  # new session ids, the same clients
    again = setup_round(K6, {new: inputs[old] for new, old in rejoined.items()},
                        RoundId("run-1", 1, 2),
                        {new: make_client(new, 0, authenticated=False, ledger=ledgers[old])
                         for new, old in rejoined.items()}, authenticated=False)
    with pytest.raises(SecureAggregationError):
        run(again)
    assert set(again.refusals) == set(rejoined)
    assert all("may be in the sum of an earlier attempt" in why
               for why in again.refusals.values())
    # without the shared ledger (a client that forgot), the second sum would exist
    forgetful = setup_round(K6, {new: inputs[old] for new, old in rejoined.items()},
                            RoundId("run-1", 1, 3),
                            {new: make_client(new, 0, authenticated=False)
                             for new in rejoined}, authenticated=False)
    assert run(forgetful).server.status is SecAggStatus.SUCCEEDED
