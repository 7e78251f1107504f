"""Clients reject tampered, replayed, misaddressed and malformed shares, and too few of
them, and the round goes on without the client that received them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from clients_defend_support import BOTH_MODES, CONFIG
from secagg_driver import Hook, ids_of, make_inputs, pki, plaintext_mean, run, setup_round

from fedloom.errors import SecureAggregationError
from fedloom.secagg import (
    MASK_KEY,
    SELF_MASK,
    SHARE_BYTES,
    AdvertisedKeys,
    AdvertiseKeysRequest,
    EncryptedShare,
    MaskedInputRequest,
    RoundId,
    RoundSetup,
    ShareCommitment,
    ShareKeysReply,
    ShareKeysRequest,
    Stage,
    agree,
    commit_self_mask,
    commit_share,
    derive_share_key,
    generate_private_key,
    graph_seed,
    key_statement,
    neighbour_graph,
    new_seed,
    private_bytes,
    public_bytes,
    seal_share,
    split,
)

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
        ("commitment", "do not match the commitments published with them (a dealer that "
                       "commits to one share and sends another)"),
        ("non_neighbour", "which is not a neighbour of this client"),
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
        if how == "non_neighbour":  # the share as sent, under a non-neighbour's name
            graph = rnd.server.graph
            stranger = next(c for c in ids if c != target and c not in graph[target])
            return dataclasses.replace(s, sender=stranger), c
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


def _keep_shares(target: str, keep: int) -> Hook:
    """The server delivers only the first ``keep`` of the target's shares."""
    def hook(stage: Stage, cid: str, request: Any) -> Any:
        if stage is Stage.MASKED_INPUT and cid == target:
            return MaskedInputRequest(request.round_id, request.shares[:keep],
                                      request.commitments[:keep])
        return request
    return hook


@BOTH_MODES
@pytest.mark.parametrize("keep", [CONFIG.threshold - 1, CONFIG.threshold])
def test_a_client_masks_only_when_it_holds_at_least_t_shares(keep: int,
                                                             authenticated: bool) -> None:
    """With fewer than t neighbours' shares, this client's pairwise masks with the others
    could not be removed once it drops: it refuses to mask. With t it masks."""
    ids = ids_of(12)
    target = ids[4]
    rnd = run(setup_round(CONFIG, make_inputs(ids, 8), authenticated=authenticated),
              tamper_request=_keep_shares(target, keep),
              stop_at=Stage.CONSISTENCY if authenticated else Stage.UNMASK)
    t = CONFIG.threshold
    if keep < t:
        assert rnd.refusals[target] == (
            f"client {target!r} refuses: only {keep} neighbours shared keys; at least the "
            f"threshold ({t}) must survive for this input to be unmasked")
        assert target not in rnd.server.survivors
    else:
        assert target not in rnd.refusals
        assert target in rnd.server.survivors  # its masked input was taken


class LengthCheatingDealer:
    """A participant that colludes with the server: it deals honest shares, and also
    seals for one neighbour (the victim) a share of ``length`` bytes under their pairwise
    key, with commitments that match it, which the server delivers in place of the
    honest one. Only the receiver's length check can refuse it. It leaves after
    share_keys."""

    def __init__(self, client_id: str, length: int, authenticated: bool) -> None:
        self.client_id, self.length = client_id, length
        self.identity = pki().identity(client_id) if authenticated else None
        self.cipher_key, self.mask_key = generate_private_key(), generate_private_key()
        self.setup: RoundSetup | None = None
        self.victim = ""
        self.swap: tuple[EncryptedShare, ShareCommitment] | None = None

    def handle(self, request: Any, **_: Any) -> Any:
        if isinstance(request, AdvertiseKeysRequest):
            self.setup = setup = request.setup
            keys = (public_bytes(self.cipher_key), public_bytes(self.mask_key))
            if self.identity is None:
                return AdvertisedKeys(setup.round_id, self.client_id, *keys)
            signature = self.identity.sign(key_statement(setup, self.client_id, *keys))
            return AdvertisedKeys(setup.round_id, self.client_id, *keys,
                                  self.identity.certificate_der, signature)
        if isinstance(request, ShareKeysRequest):
            return self._share_keys(request)
        raise SecureAggregationError("the cheating dealer is gone")

    def _share_keys(self, request: ShareKeysRequest) -> ShareKeysReply:
        setup, me = self.setup, self.client_id
        assert setup is not None
        roster = {k.client_id: k for k in request.roster}
        seed = graph_seed(setup, request.roster)
        neighbours = sorted(neighbour_graph(roster, setup.neighbours, seed)[me])
        self.victim = neighbours[0]
        xs = [setup.x_coordinate(v) for v in neighbours]
        self_mask_seed = new_seed()
        key_shares = split(private_bytes(self.mask_key), setup.threshold, xs)
        seed_shares = split(self_mask_seed, setup.threshold, xs)
        shares, commitments = [], []
        for v, key_share, seed_share in zip(neighbours, key_shares, seed_shares, strict=True):
            pairwise = derive_share_key(agree(self.cipher_key, roster[v].cipher_public_key),
                                        setup, me, v)

            def sealed(plaintext: bytes, v: str = v, key: bytes = pairwise
                       ) -> tuple[EncryptedShare, ShareCommitment]:
                nonce, ciphertext = seal_share(key, setup, me, v, plaintext, graph_seed=seed)
                head, tail = plaintext[:SHARE_BYTES], plaintext[SHARE_BYTES:]
                return (EncryptedShare(me, v, nonce, ciphertext),
                        ShareCommitment(v, commit_share(setup, me, v, MASK_KEY, head),
                                        commit_share(setup, me, v, SELF_MASK, tail)))

            share, commitment = sealed(key_share + seed_share)
            shares.append(share)
            commitments.append(commitment)
            if v == self.victim:
                honest = key_share + seed_share
                self.swap = sealed((honest + bytes(self.length))[: self.length])
        return ShareKeysReply(setup.round_id, me, tuple(shares),
                              commit_self_mask(setup, me, self_mask_seed), tuple(commitments))


@BOTH_MODES
@pytest.mark.parametrize("length", [0, SHARE_BYTES, 2 * SHARE_BYTES - 1, 2 * SHARE_BYTES + 1])
def test_a_share_of_the_wrong_length_is_refused_even_when_committed(length: int,
                                                                    authenticated: bool) -> None:
    ids = ids_of(12)
    dealer = LengthCheatingDealer(ids[7], length, authenticated)
    rnd = setup_round(CONFIG, make_inputs(ids, 8), authenticated=authenticated)
    rnd.clients[dealer.client_id] = dealer  # type: ignore[assignment]

    def swap(stage: Stage, cid: str, request: Any) -> Any:
        if stage is not Stage.MASKED_INPUT or cid != dealer.victim:
            return request
        assert dealer.swap is not None
        at = [s.sender for s in request.shares].index(dealer.client_id)
        shares, commitments = list(request.shares), list(request.commitments)
        shares[at], commitments[at] = dealer.swap
        return MaskedInputRequest(request.round_id, tuple(shares), tuple(commitments))

    run(rnd, tamper_request=swap)
    victim = dealer.victim
    assert rnd.refusals[victim] == (
        f"client {victim!r} refuses: the share from {dealer.client_id!r} is malformed")
    survivors = rnd.server.result.survivors
    assert victim not in survivors and dealer.client_id not in survivors
    assert len(survivors) == len(ids) - 2  # the others finish the round without them
