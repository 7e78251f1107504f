"""Clients protect themselves: bad survivor sets, split views, tampered and replayed
shares, foreign keys and attempts, in authenticated and unauthenticated attempts."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from secagg_driver import (
    Hook,
    Round,
    ids_of,
    make_client,
    make_inputs,
    make_setup,
    pki,
    plaintext_mean,
    run,
    setup_round,
)

from fedloom.errors import MessageRejectedError, SecureAggregationError
from fedloom.secagg import (
    AdvertisedKeys,
    AdvertiseKeysRequest,
    Confirmation,
    ConsistencyReply,
    ConsistencyRequest,
    EncryptedShare,
    MaskedInputRequest,
    RoundId,
    SecAggConfig,
    SecAggServer,
    ShareCommitment,
    ShareKeysReply,
    ShareKeysRequest,
    Stage,
    UnmaskReply,
    UnmaskRequest,
    commit_self_mask,
    key_statement,
    private_key_from_bytes,
    public_bytes,
)
from fedloom.secagg._unmask import reconstruct_checked

CONFIG = SecAggConfig(enabled=True, neighbours=6, threshold=4, clip_range=3.0, bits=20,
                      max_weight=100.0, max_participants=64)
FULL = SecAggConfig(enabled=True, neighbours=10, threshold=6, clip_range=1.0, bits=20,
                    max_weight=100.0, max_participants=64)

BOTH_MODES = pytest.mark.parametrize("authenticated", [True, False],
                                     ids=["authenticated", "unauthenticated"])


def _at(stage: Stage, authenticated: bool, config: SecAggConfig = CONFIG,
        n: int = 12) -> Round:
    return run(setup_round(config, make_inputs(ids_of(n), 8), authenticated=authenticated),
               stop_at=stage)


def _honest(server: SecAggServer, cid: str) -> UnmaskRequest:
    request = server.request_for(cid)
    assert isinstance(request, UnmaskRequest)
    return request


# -- what one unmask answer reveals ----------------------------------------------------


@BOTH_MODES
def test_one_unmask_reply_reveals_one_share_of_each_neighbour(authenticated: bool) -> None:
    """The survivor set alone says who survived (a neighbour outside it dropped), so a
    request cannot name one client both ways: each reply holds the self-mask share of
    every surviving neighbour and the mask-key share of every dropped one, never both."""
    ids = ids_of(12)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 8), authenticated=authenticated),
              drop_at=dict.fromkeys(ids[2:4], Stage.MASKED_INPUT))
    graph, survivors = rnd.server.graph, set(rnd.server.result.survivors)
    replies = [(c, r) for _, c, _, r in rnd.transcript if isinstance(r, UnmaskReply)]
    assert len(replies) == 10
    revealed_keys = set()
    for cid, reply in replies:
        seeds = {s.owner for s in reply.self_mask_shares}
        keys = {s.owner for s in reply.mask_key_shares}
        assert not seeds & keys
        assert seeds == graph[cid] & survivors
        assert keys == graph[cid] - survivors
        revealed_keys |= keys
    assert revealed_keys == set(ids[2:4]) & set().union(*(graph[c] for c in survivors))


@BOTH_MODES
def test_a_second_different_unmask_request_is_refused(authenticated: bool) -> None:
    """The server asks for v's self-mask share (v 'survived'), then for its mask-key
    share (v 'dropped'): the second answer would complete both secrets of v."""
    rnd = _at(Stage.UNMASK, authenticated)
    server = rnd.server
    cid = ids_of(12)[0]
    honest = _honest(server, cid)
    victim = min(server.graph[cid] & set(honest.survivors))
    first = rnd.clients[cid].handle(honest)
    assert isinstance(first, UnmaskReply)
    assert victim in [s.owner for s in first.self_mask_shares]
    flipped = UnmaskRequest(honest.round_id, tuple(v for v in honest.survivors if v != victim),
                            honest.confirmations)
    with pytest.raises(SecureAggregationError, match="second, different unmask"):
        rnd.clients[cid].handle(flipped)
    with pytest.raises(SecureAggregationError):  # the refusal ended the attempt
        rnd.clients[cid].handle(honest)


def _survivor_set_request(rnd: Round, cid: str, survivors: tuple[str, ...]) -> Any:
    """A request that asks ``cid`` to act on ``survivors``: to confirm it (authenticated
    attempts check the set at consistency) or to unmask under it."""
    rid = rnd.server.setup.round_id
    if rnd.server.setup.authenticated:
        return ConsistencyRequest(rid, survivors)
    return UnmaskRequest(rid, survivors)


@BOTH_MODES
@pytest.mark.parametrize(("how", "match"), [
    ("stranger", "advertised no keys"),
    ("left_out", "leaves this client out"),
    ("too_few", "fewer than the threshold"),
])
def test_bad_survivor_sets_are_refused(authenticated: bool, how: str, match: str) -> None:
    stage = Stage.CONSISTENCY if authenticated else Stage.UNMASK
    rnd = _at(stage, authenticated)
    server = rnd.server
    cid = ids_of(12)[0]
    honest = server.request_for(cid)
    survivors = list(honest.survivors)
    if how == "stranger":
        survivors.append("zz-not-a-participant")
    elif how == "left_out":
        survivors.remove(cid)
    else:  # all but three of its neighbours 'dropped': it would reveal their mask keys
        survivors = [c for c in survivors if c not in sorted(server.graph[cid])[3:]]
    with pytest.raises(SecureAggregationError, match=match):
        rnd.clients[cid].handle(_survivor_set_request(rnd, cid, tuple(survivors)))
    with pytest.raises(SecureAggregationError):  # the refusal ended the attempt
        rnd.clients[cid].handle(honest)


def test_a_survivor_set_that_lists_a_client_twice_cannot_be_sent() -> None:
    rid = RoundId("run-1", 1, 1)
    for make in (ConsistencyRequest, UnmaskRequest):
        with pytest.raises(MessageRejectedError, match="sorted and unique"):
            make(rid, ("client-000", "client-001", "client-001"))
    with pytest.raises(MessageRejectedError, match="listed twice"):
        UnmaskRequest(rid, ("client-000", "client-001"),
                      (Confirmation("client-000", b"s"), Confirmation("client-000", b"t")))


def _split_attack(a: int, authenticated: bool) -> tuple[bool, bool]:
    """Tell ``a`` of the victim's 10 neighbours it survived, the rest that it dropped;
    return whether its self-mask seed and its mask key can then be reconstructed.

    Authenticated: the split happens at consistency (each group confirms its own set,
    the victim confirms the set with itself in it), and each neighbour is then shown
    every confirmation of its set by its neighbours (all the server has)."""
    ids = ids_of(11)
    rnd = _at(Stage.CONSISTENCY if authenticated else Stage.UNMASK, authenticated, FULL, 11)
    server = rnd.server
    setup = server.setup
    victim = ids[0]
    neighbours = sorted(server.graph[victim])
    with_victim, without = tuple(ids), tuple(ids[1:])
    view = {c: with_victim if i < a else without for i, c in enumerate(neighbours)}
    view[victim] = with_victim
    signed: dict[tuple[str, ...], dict[str, bytes]] = {with_victim: {}, without: {}}
    if authenticated:
        for cid, survivors in view.items():
            reply = rnd.clients[cid].handle(ConsistencyRequest(setup.round_id, survivors))
            assert isinstance(reply, ConsistencyReply)
            signed[survivors][cid] = reply.signature
    keys = {r.client_id: r for _, _, _, r in rnd.transcript if isinstance(r, AdvertisedKeys)}
    commitments = {r.client_id: r.self_mask_commitment
                   for _, _, _, r in rnd.transcript if isinstance(r, ShareKeysReply)}
    seeds: dict[int, bytes] = {}
    mask_keys: dict[int, bytes] = {}
    for cid in neighbours:
        survivors = view[cid]
        confirmations = tuple(Confirmation(v, sig) for v, sig in sorted(signed[survivors].items())
                              if v in server.graph[cid])
        try:
            reply = rnd.clients[cid].handle(UnmaskRequest(setup.round_id, survivors,
                                                          confirmations))
        except SecureAggregationError as exc:
            assert authenticated and "confirmed the survivor set" in str(exc)
            continue
        assert isinstance(reply, UnmaskReply)
        x = setup.x_coordinate(cid)
        for share in reply.self_mask_shares:
            if share.owner == victim:
                seeds[x] = share.value
        for share in reply.mask_key_shares:
            if share.owner == victim:
                mask_keys[x] = share.value

    def is_seed(b: bytes) -> bool:
        return commit_self_mask(setup, victim, b) == commitments[victim]

    def is_key(s: bytes) -> bool:
        return public_bytes(private_key_from_bytes(s)) == keys[victim].mask_public_key

    def recovered(shares: dict[int, bytes], check: Callable[[bytes], bool]) -> bool:
        try:
            reconstruct_checked(shares, 6, check, "attack")
        except SecureAggregationError:
            return False
        return True

    return recovered(seeds, is_seed), recovered(mask_keys, is_key)


@BOTH_MODES
@pytest.mark.parametrize("a", range(11))
def test_split_views_never_yield_both_secrets_of_a_client(a: int, authenticated: bool) -> None:
    """The server tells a of v's 10 neighbours that v survived and the other 10 - a that
    it dropped. Since t = 6 > k/2, it reconstructs b_v only when a >= 6 and s_v only when
    10 - a >= 6: never both, for every split. Authenticated, a neighbour also needs t
    confirmations of its set from its neighbours: the a who saw v survive have a - 1
    others and v's own, the 10 - a others only 9 - a, so s_v needs 10 - a >= 7."""
    has_seed, has_key = _split_attack(a, authenticated)
    assert not (has_seed and has_key)
    assert has_seed == (a >= 6)
    assert has_key == (10 - a >= (7 if authenticated else 6))


# -- tampered, replayed and misaddressed shares --------------------------------------

Change = Callable[[list[EncryptedShare], list[ShareCommitment]],
                  tuple[EncryptedShare, ShareCommitment]]


def _tamper_one_share(target: str, change: Change) -> Hook:
    def hook(stage: Stage, cid: str, request: Any) -> Any:
        if stage is Stage.MASKED_INPUT and cid == target:
            shares, commitments = list(request.shares), list(request.commitments)
            shares[0], commitments[0] = change(shares, commitments)
            return MaskedInputRequest(request.round_id, tuple(shares), tuple(commitments))
        return request
    return hook


def _flip(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x40
    return bytes(out)


@BOTH_MODES
@pytest.mark.parametrize(
    ("how", "match"),
    [
        ("ciphertext", "failed authentication"),
        ("tag", "failed authentication"),
        ("nonce", "failed authentication"),
        ("turned_around", "failed authentication"),
        ("misaddressed", "addressed to"),
        ("relabelled_receiver", "failed authentication"),
        ("duplicate", "replay"),
        ("commitment", "do not match the commitments"),
    ],
)
def test_bad_shares_are_rejected_and_the_round_goes_on(how: str, match: str,
                                                       authenticated: bool) -> None:
    ids = ids_of(12)
    rnd = setup_round(CONFIG, make_inputs(ids, 8), authenticated=authenticated)
    target = ids[4]
    relayed: dict[tuple[str, str], EncryptedShare] = {}

    def record(stage: Stage, cid: str, reply: Any) -> Any:
        if stage is Stage.SHARE_KEYS:
            for s in reply.shares:
                relayed[(s.sender, s.receiver)] = s
        return reply

    def change(shares: list[EncryptedShare], commitments: list[ShareCommitment]
               ) -> tuple[EncryptedShare, ShareCommitment]:
        s, c = shares[0], commitments[0]
        if how == "ciphertext":
            return dataclasses.replace(s, ciphertext=_flip(s.ciphertext, 3)), c
        if how == "tag":
            return dataclasses.replace(s, ciphertext=_flip(s.ciphertext, -1)), c
        if how == "nonce":
            return dataclasses.replace(s, nonce=_flip(s.nonce, 0)), c
        if how == "turned_around":  # the target's own share for s.sender, relabelled
            back = relayed[(target, s.sender)]
            return EncryptedShare(s.sender, target, back.nonce, back.ciphertext), c
        if how == "duplicate":  # shares[0] := shares[1]
            return shares[1], commitments[1]
        if how == "commitment":  # the share as sent, another commitment published
            return s, dataclasses.replace(c, self_mask=_flip(c.self_mask, 5))
        other = next(r for (snd, r) in relayed if snd == s.sender and r != target)
        wrong = relayed[(s.sender, other)]
        if how == "misaddressed":
            return wrong, dataclasses.replace(c, holder=other)
        return dataclasses.replace(wrong, receiver=target), c  # relabelled_receiver

    run(rnd, tamper_request=_tamper_one_share(target, change), tamper_reply=record)
    assert match in rnd.refusals[target]
    survivors = [c for c in ids if c != target]
    assert rnd.server.result.survivors == tuple(survivors)
    assert rnd.server.result.dropped == (target,)  # it had shared keys: masks removed
    mean, _, _ = plaintext_mean(CONFIG, rnd.inputs, tuple(survivors))
    assert np.allclose(rnd.server.result.mean, mean, atol=24 * CONFIG.quantum)


@BOTH_MODES
def test_share_replayed_from_another_attempt_is_rejected(authenticated: bool) -> None:
    ids = ids_of(10)
    inputs = make_inputs(ids, 8)
    first = run(setup_round(CONFIG, inputs, authenticated=authenticated),
                stop_at=Stage.MASKED_INPUT)
    target = ids[2]
    old = first.server.request_for(target)
    assert isinstance(old, MaskedInputRequest)
    for client in first.clients.values():
        client.abort()
    second = setup_round(CONFIG, inputs, round_id=RoundId("run-1", 1, 2), clients=first.clients,
                         authenticated=authenticated)

    def replay(shares: list[EncryptedShare], commitments: list[ShareCommitment]
               ) -> tuple[EncryptedShare, ShareCommitment]:
        # the graph is drawn anew per attempt: the same sender if it is still a
        # neighbour, else an old ciphertext under the current sender's name
        same = [s for s in old.shares if s.sender == shares[0].sender]
        share = same[0] if same else dataclasses.replace(old.shares[0],
                                                         sender=shares[0].sender)
        return share, commitments[0]

    run(second, tamper_request=_tamper_one_share(target, replay))
    assert "failed authentication" in second.refusals[target]
    assert target not in second.server.result.survivors


# -- the client's own rules for keys, attempts and order -------------------------------


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
    with pytest.raises(SecureAggregationError, match="substituted"):
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
        with pytest.raises(SecureAggregationError, match="leaves out 1 participants"):
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
    with pytest.raises(SecureAggregationError, match="revealed shares in an earlier attempt"):
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
    with pytest.raises(SecureAggregationError, match="not among"):
        outsider.handle(AdvertiseKeysRequest(rnd.server.setup))


def test_a_consistency_request_is_refused_in_an_unauthenticated_attempt() -> None:
    rnd = _at(Stage.UNMASK, authenticated=False)
    cid = ids_of(12)[0]
    honest = rnd.server.request_for(cid)
    with pytest.raises(SecureAggregationError, match="no consistency stage"):
        rnd.clients[cid].handle(ConsistencyRequest(honest.round_id, honest.survivors))


def test_an_authenticated_unmask_without_confirming_first_is_out_of_order() -> None:
    rnd = _at(Stage.CONSISTENCY, authenticated=True)
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
