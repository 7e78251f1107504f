"""Clients reject tampered, replayed and misaddressed shares, and the round goes on
without the client that received them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from clients_defend_support import BOTH_MODES, CONFIG
from secagg_driver import Hook, ids_of, make_inputs, plaintext_mean, run, setup_round

from fedloom.secagg import EncryptedShare, MaskedInputRequest, RoundId, ShareCommitment, Stage

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
