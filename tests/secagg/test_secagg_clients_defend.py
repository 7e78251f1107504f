"""Clients protect themselves: malicious-server stubs, tampered and replayed shares."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from secagg_driver import Hook, Round, ids_of, make_inputs, plaintext_mean, run, setup_round

from fedloom.errors import SecureAggregationError
from fedloom.secagg import (
    AdvertisedKeys,
    AdvertiseKeysRequest,
    EncryptedShare,
    MaskedInputRequest,
    RoundId,
    RoundSetup,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    ShareKeysReply,
    ShareKeysRequest,
    Stage,
    UnmaskReply,
    UnmaskRequest,
    commit_self_mask,
    private_key_from_bytes,
    public_bytes,
)
from fedloom.secagg._unmask import reconstruct_checked

CONFIG = SecAggConfig(enabled=True, neighbours=6, threshold=4, clip_range=3.0, bits=20,
                      max_weight=100.0, max_participants=64)
FULL = SecAggConfig(enabled=True, neighbours=10, threshold=6, clip_range=1.0, bits=20,
                    max_weight=100.0, max_participants=64)


def _at_unmask(config: SecAggConfig = CONFIG, n: int = 12) -> tuple[Round, SecAggServer]:
    rnd = run(setup_round(config, make_inputs(ids_of(n), 8)), stop_at=Stage.UNMASK)
    return rnd, rnd.server


def _honest(server: SecAggServer, cid: str) -> UnmaskRequest:
    request = server.request_for(cid)
    assert isinstance(request, UnmaskRequest)
    return request


# -- a malicious server at the unmask stage -------------------------------------------


def test_asking_for_both_shares_of_one_client_is_refused() -> None:
    rnd, server = _at_unmask()
    cid = ids_of(12)[0]
    honest = _honest(server, cid)
    victim = honest.survivors[0]
    both = UnmaskRequest(honest.round_id, honest.survivors, (*honest.dropped, victim))
    with pytest.raises(SecureAggregationError, match="both survived and dropped"):
        rnd.clients[cid].handle(both)
    # the refusal ended this client's attempt: it now reveals nothing at all
    with pytest.raises(SecureAggregationError):
        rnd.clients[cid].handle(honest)


def test_a_second_different_unmask_request_is_refused() -> None:
    """The server asks for v's self-mask share (v 'survived'), then for its mask-key
    share (v 'dropped'): the second answer would complete both secrets of v."""
    rnd, server = _at_unmask()
    cid = ids_of(12)[0]
    honest = _honest(server, cid)
    victim = honest.survivors[0]
    first = rnd.clients[cid].handle(honest)
    assert isinstance(first, UnmaskReply)
    assert victim in [s.owner for s in first.self_mask_shares]
    flipped = UnmaskRequest(honest.round_id, tuple(v for v in honest.survivors if v != victim),
                            (*honest.dropped, victim))
    with pytest.raises(SecureAggregationError, match="second, different unmask"):
        rnd.clients[cid].handle(flipped)
    with pytest.raises(SecureAggregationError):  # the refusal ended the attempt
        rnd.clients[cid].handle(honest)


@pytest.mark.parametrize("how", ["stranger", "left_out", "too_few", "duplicate"])
def test_malformed_unmask_requests_are_refused(how: str) -> None:
    rnd, server = _at_unmask()
    cid = ids_of(12)[0]
    honest = _honest(server, cid)
    survivors, dropped = list(honest.survivors), list(honest.dropped)
    if how == "stranger":
        outsider = next(c for c in ids_of(12) if c != cid and c not in server.graph[cid])
        survivors.append(outsider)
        match = "not neighbours"
    elif how == "left_out":
        survivors.pop()
        match = "leaves out"
    elif how == "too_few":  # every neighbour but three 'dropped': reveals 3 mask keys
        dropped += survivors[3:]
        survivors = survivors[:3]
        match = "fewer than the threshold"
    else:
        survivors.append(survivors[0])
        match = "twice"
    with pytest.raises(SecureAggregationError, match=match):
        rnd.clients[cid].handle(UnmaskRequest(honest.round_id, tuple(survivors),
                                              tuple(dropped)))


def _split_attack(a: int) -> tuple[bool, bool]:
    """Tell ``a`` of the victim's neighbours it survived, the rest that it dropped;
    return whether its self-mask seed and its mask key can then be reconstructed."""
    rnd, server = _at_unmask(FULL, n=11)
    setup = server.setup
    victim = ids_of(11)[0]
    keys = {r.client_id: r for _, _, _, r in rnd.transcript if isinstance(r, AdvertisedKeys)}
    commitments = {r.client_id: r.self_mask_commitment
                   for _, _, _, r in rnd.transcript if isinstance(r, ShareKeysReply)}
    seeds: dict[int, bytes] = {}
    mask_keys: dict[int, bytes] = {}
    for i, cid in enumerate(sorted(server.graph[victim])):
        request = _honest(server, cid)
        if i >= a:  # tell this one that the victim dropped
            request = UnmaskRequest(request.round_id,
                                    tuple(v for v in request.survivors if v != victim),
                                    (*request.dropped, victim))
        reply = rnd.clients[cid].handle(request)
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


@pytest.mark.parametrize("a", range(11))
def test_split_views_never_yield_both_secrets_of_a_client(a: int) -> None:
    """The server tells a of v's 10 neighbours that v survived and the other 10 - a that
    it dropped. Since t = 6 > k/2, it reconstructs b_v only when a >= 6 and s_v only when
    10 - a >= 6: never both, for every split."""
    has_seed, has_key = _split_attack(a)
    assert not (has_seed and has_key)
    assert has_seed == (a >= 6) and has_key == (10 - a >= 6)


# -- tampered, replayed and misaddressed shares --------------------------------------


def _tamper_one_share(target: str, change: Callable[[list[EncryptedShare]], EncryptedShare]
                      ) -> Hook:
    def hook(stage: Stage, cid: str, request: Any) -> Any:
        if stage is Stage.MASKED_INPUT and cid == target:
            shares = list(request.shares)
            shares[0] = change(shares)
            return MaskedInputRequest(request.round_id, tuple(shares))
        return request
    return hook


def _flip(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x40
    return bytes(out)


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
    ],
)
def test_bad_share_ciphertexts_are_rejected_and_the_round_goes_on(how: str, match: str) -> None:
    ids = ids_of(12)
    rnd = setup_round(CONFIG, make_inputs(ids, 8))
    target = ids[4]
    relayed: dict[tuple[str, str], EncryptedShare] = {}

    def record(stage: Stage, cid: str, reply: Any) -> Any:
        if stage is Stage.SHARE_KEYS:
            for s in reply.shares:
                relayed[(s.sender, s.receiver)] = s
        return reply

    def change(shares: list[EncryptedShare]) -> EncryptedShare:
        s = shares[0]
        if how == "ciphertext":
            return dataclasses.replace(s, ciphertext=_flip(s.ciphertext, 3))
        if how == "tag":
            return dataclasses.replace(s, ciphertext=_flip(s.ciphertext, -1))
        if how == "nonce":
            return dataclasses.replace(s, nonce=_flip(s.nonce, 0))
        if how == "turned_around":  # the target's own share for s.sender, relabelled
            back = relayed[(target, s.sender)]
            return EncryptedShare(s.sender, target, back.nonce, back.ciphertext)
        other = next(r for (snd, r) in relayed if snd == s.sender and r != target)
        wrong = relayed[(s.sender, other)]
        if how == "misaddressed":
            return wrong
        if how == "relabelled_receiver":
            return dataclasses.replace(wrong, receiver=target)
        return shares[1]  # duplicate: shares[0] := shares[1]

    run(rnd, tamper_request=_tamper_one_share(target, change), tamper_reply=record)
    assert match in rnd.refusals[target]
    survivors = [c for c in ids if c != target]
    assert rnd.server.result.survivors == tuple(survivors)
    assert rnd.server.result.dropped == (target,)  # it had shared keys: masks removed
    mean, _, _ = plaintext_mean(CONFIG, rnd.inputs, tuple(survivors))
    assert np.allclose(rnd.server.result.mean, mean, atol=24 * CONFIG.quantum)


def test_share_replayed_from_another_attempt_is_rejected() -> None:
    ids = ids_of(10)
    inputs = make_inputs(ids, 8)
    first = run(setup_round(CONFIG, inputs), stop_at=Stage.MASKED_INPUT)
    target = ids[2]
    old = first.server.request_for(target)
    assert isinstance(old, MaskedInputRequest)
    for client in first.clients.values():
        client.abort()
    second = setup_round(CONFIG, inputs, round_id=RoundId("run-1", 1, 1), clients=first.clients)

    def replay(shares: list[EncryptedShare]) -> EncryptedShare:
        # the graph is drawn anew per attempt: the same sender if it is still a
        # neighbour, else an old ciphertext under the current sender's name
        same = [s for s in old.shares if s.sender == shares[0].sender]
        return same[0] if same else dataclasses.replace(old.shares[0],
                                                        sender=shares[0].sender)

    run(second, tamper_request=_tamper_one_share(target, replay))
    assert "failed authentication" in second.refusals[target]
    assert target not in second.server.result.survivors


# -- the client's own rules for keys, attempts and order -------------------------------


def test_duplicate_or_foreign_neighbour_keys_are_refused() -> None:
    ids = ids_of(10)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 8)), stop_at=Stage.SHARE_KEYS)
    server = rnd.server
    cid = ids[0]
    honest = server.request_for(cid)
    assert isinstance(honest, ShareKeysRequest)
    same = dataclasses.replace(honest.neighbours[1],
                               mask_public_key=honest.neighbours[0].mask_public_key)
    with pytest.raises(SecureAggregationError, match="substituted"):
        rnd.clients[cid].handle(ShareKeysRequest(honest.round_id,
                                                 (honest.neighbours[0], same,
                                                  *honest.neighbours[2:])))
    other = ids[1]
    stranger_id = next(c for c in ids if c != other and c not in server.graph[other])
    request = server.request_for(other)
    assert isinstance(request, ShareKeysRequest)
    foreign = dataclasses.replace(request.neighbours[0], client_id=stranger_id)
    with pytest.raises(SecureAggregationError, match="not a neighbour"):
        rnd.clients[other].handle(ShareKeysRequest(request.round_id,
                                                   (foreign, *request.neighbours[1:])))


def test_used_and_older_attempts_are_refused() -> None:
    ids = ids_of(8)
    inputs = make_inputs(ids, 8)
    rnd = run(setup_round(CONFIG, inputs, round_id=RoundId("run-1", 4, 2)))
    client = rnd.clients[ids[0]]
    for attempt in (2, 1, 0):  # attempt 2 was used; 1 and 0 are older
        setup = RoundSetup.create(CONFIG, RoundId("run-1", 4, attempt), ids, 8)
        with pytest.raises(SecureAggregationError, match="already used or is older"):
            client.handle(AdvertiseKeysRequest(setup))
    fresh = RoundSetup.create(CONFIG, RoundId("run-1", 4, 3), ids, 8)
    assert isinstance(client.handle(AdvertiseKeysRequest(fresh)), AdvertisedKeys)


def test_out_of_order_and_foreign_rounds_are_refused() -> None:
    ids = ids_of(8)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 8)), stop_at=Stage.SHARE_KEYS)
    client = rnd.clients[ids[0]]
    with pytest.raises(SecureAggregationError, match="out of order"):
        client.handle(MaskedInputRequest(rnd.server.setup.round_id, ()), vector=np.zeros(8),
                      num_examples=1)
    outsider = SecAggClient("not-invited")
    with pytest.raises(SecureAggregationError, match="not among"):
        outsider.handle(AdvertiseKeysRequest(rnd.server.setup))


def test_policy_mismatch_is_refused() -> None:
    setup = RoundSetup.create(CONFIG, RoundId("r", 1, 0), ids_of(8), 4)
    weaker = dataclasses.replace(CONFIG, threshold=5)
    with pytest.raises(SecureAggregationError, match="differ"):
        SecAggClient(ids_of(8)[0], policy=weaker).handle(AdvertiseKeysRequest(setup))
    assert isinstance(SecAggClient(ids_of(8)[0], policy=CONFIG).handle(
        AdvertiseKeysRequest(setup)), AdvertisedKeys)


def test_a_stale_request_does_not_end_the_attempt_in_progress() -> None:
    ids = ids_of(8)
    inputs = make_inputs(ids, 8)
    rnd = run(setup_round(CONFIG, inputs, round_id=RoundId("run-1", 2, 5)),
              stop_at=Stage.SHARE_KEYS)
    client = rnd.clients[ids[0]]
    old = RoundSetup.create(CONFIG, RoundId("run-1", 2, 4), ids, 8)
    with pytest.raises(SecureAggregationError, match="older"):
        client.handle(AdvertiseKeysRequest(old))  # e.g. a delayed retry of attempt 4
    with pytest.raises(SecureAggregationError, match="does not match"):
        client.handle(UnmaskRequest(RoundId("run-1", 2, 4), (), ()))
    run(rnd)  # attempt 5 goes on and completes
    assert ids[0] in rnd.server.result.survivors


def test_low_order_public_key_is_refused() -> None:
    ids = ids_of(8)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 8)), stop_at=Stage.SHARE_KEYS)
    request = rnd.server.request_for(ids[0])
    assert isinstance(request, ShareKeysRequest)
    bad = dataclasses.replace(request.neighbours[0], cipher_public_key=bytes(32))
    with pytest.raises(SecureAggregationError, match="unusable X25519"):
        rnd.clients[ids[0]].handle(ShareKeysRequest(request.round_id,
                                                    (bad, *request.neighbours[1:])))
    with pytest.raises(SecureAggregationError):  # and the attempt is over
        rnd.clients[ids[0]].handle(request)


def test_secrets_are_erased_once_used() -> None:
    ids = ids_of(8)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 8)), stop_at=Stage.MASKED_INPUT)
    attempt = rnd.clients[ids[0]]._attempt
    assert attempt is not None
    assert attempt.cipher_secrets  # kept from sealing to open the neighbours' shares
    rnd = run(rnd, stop_at=Stage.UNMASK)
    assert attempt.mask_key is None and attempt.self_mask_seed is None
    assert attempt.cipher_key is None and not attempt.cipher_secrets
    assert attempt.held  # only the neighbours' shares
    run(rnd)
    assert not attempt.held  # revealed what was asked, dropped the rest
