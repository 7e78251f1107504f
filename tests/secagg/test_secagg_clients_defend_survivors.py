"""Clients protect themselves against bad survivor sets and split views: one unmask
answer per attempt, never both secrets of a client, in authenticated and unauthenticated
attempts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from clients_defend_support import BOTH_MODES, CONFIG, round_at
from secagg_driver import Round, exactly, ids_of, make_inputs, run, setup_round

from fedloom.errors import MessageRejectedError, SecureAggregationError
from fedloom.secagg import (
    AdvertisedKeys,
    Confirmation,
    ConsistencyReply,
    ConsistencyRequest,
    RoundId,
    SecAggConfig,
    SecAggServer,
    ShareKeysReply,
    Stage,
    UnmaskReply,
    UnmaskRequest,
    commit_self_mask,
    private_key_from_bytes,
    public_bytes,
)
from fedloom.secagg._unmask import reconstruct_checked

FULL = SecAggConfig(enabled=True, neighbours=10, threshold=6, clip_range=1.0, bits=20,
                    max_weight=100.0, max_participants=64)


def _honest(server: SecAggServer, cid: str) -> UnmaskRequest:
    request = server.request_for(cid)
    assert isinstance(request, UnmaskRequest)
    return request


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
    rnd = round_at(Stage.UNMASK, authenticated)
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
@pytest.mark.parametrize(("how", "why"), [
    ("stranger", "the survivor set names ['zz-not-a-participant'], which advertised no keys "
                 "in this attempt"),
    ("left_out", "the survivor set leaves this client out, yet asks it to act on it"),
    ("too_few", "only 3 surviving neighbours; fewer than the threshold (4) would expose too "
                "small a sum"),
])
def test_bad_survivor_sets_are_refused(authenticated: bool, how: str, why: str) -> None:
    stage = Stage.CONSISTENCY if authenticated else Stage.UNMASK
    rnd = round_at(stage, authenticated)
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
    refusal = f"client {cid!r} refuses: {why}"
    with pytest.raises(SecureAggregationError, match=exactly(refusal)):
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
    rnd = round_at(Stage.CONSISTENCY if authenticated else Stage.UNMASK, authenticated, FULL, 11)
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
