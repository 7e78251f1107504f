"""Verifiable shares: every dealt share is committed to; the server checks each revealed
share against its commitment (a wrong one is refused and the stage finishes from the
other neighbours' shares), and names a dealer whose checked shares do not reconstruct
its secret."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from secagg_driver import Round, assert_matches_plaintext, ids_of, make_inputs, run, setup_round

from fedloom.errors import MessageRejectedError, RejectReason, SecureAggregationError
from fedloom.secagg import (
    MASK_KEY,
    PRIME,
    SELF_MASK,
    SHARE_BYTES,
    EncryptedShare,
    RevealedShare,
    SecAggConfig,
    SecAggStatus,
    ShareCommitment,
    ShareKeysReply,
    Stage,
    UnmaskReply,
    commit_share,
    derive_share_key,
    private_bytes,
    seal_share,
    split,
)

CONFIG = SecAggConfig(enabled=True, neighbours=6, threshold=4, clip_range=3.0, bits=20,
                      max_weight=100.0, max_participants=64)

BOTH_MODES = pytest.mark.parametrize("authenticated", [True, False],
                                     ids=["authenticated", "unauthenticated"])


def _shifted(share: RevealedShare) -> RevealedShare:
    """Another field element in place of the share (what a corrupting holder sends)."""
    value = (int.from_bytes(share.value, "big") + 1) % PRIME
    return dataclasses.replace(share, value=value.to_bytes(SHARE_BYTES, "big"))


@BOTH_MODES
@pytest.mark.parametrize("kind", ["self_mask_shares", "mask_key_shares"])
def test_a_revealed_share_that_misses_its_commitment_is_refused_and_spares_finish(
        authenticated: bool, kind: str) -> None:
    """One holder reveals a wrong share; the server refuses its whole reply and finishes
    from the other neighbours' shares (k = 6 holders, t = 4 needed)."""
    ids = ids_of(12)
    dropped = ids[5]
    rnd = run(setup_round(CONFIG, make_inputs(ids, 16), authenticated=authenticated),
              drop_at={dropped: Stage.MASKED_INPUT}, stop_at=Stage.UNMASK)
    server = rnd.server
    holder = min(server.graph[dropped] & server.survivors)  # it holds a share of each kind
    reply = rnd.clients[holder].handle(server.request_for(holder))
    assert isinstance(reply, UnmaskReply)
    shares = list(getattr(reply, kind))
    assert shares
    shares[0] = _shifted(shares[0])
    with pytest.raises(MessageRejectedError, match="does not match the commitment") as info:
        server.receive(holder, dataclasses.replace(reply, **{kind: tuple(shares)}))
    assert info.value.reason is RejectReason.INVALID
    server.drop(holder)  # the transport drops the client whose reply was refused
    assert not server.can_finish()
    for cid in sorted(server.pending()):
        server.receive(cid, rnd.clients[cid].handle(server.request_for(cid)))
    assert server.can_finish()
    server.advance()
    assert server.status is SecAggStatus.SUCCEEDED
    survivors = [c for c in ids if c != dropped]
    assert holder in server.result.survivors  # its input is in the sum all the same
    assert server.result.dropped == (dropped,)
    assert_matches_plaintext(CONFIG, rnd, survivors)


def test_revealed_shares_must_be_field_elements_for_exactly_the_held_owners() -> None:
    ids = ids_of(10)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 4)), stop_at=Stage.UNMASK)
    server, cid = rnd.server, ids[0]
    reply = rnd.clients[cid].handle(server.request_for(cid))
    assert isinstance(reply, UnmaskReply)
    first = reply.self_mask_shares[0]
    too_big = dataclasses.replace(first, value=PRIME.to_bytes(SHARE_BYTES, "big"))
    short = dataclasses.replace(first, value=first.value[1:])
    for bad, match in (((too_big, *reply.self_mask_shares[1:]), "not a field element"),
                       ((short, *reply.self_mask_shares[1:]), "not a field element"),
                       (reply.self_mask_shares[1:], "must be for exactly"),
                       ((*reply.self_mask_shares, first), "must be for exactly")):
        with pytest.raises(MessageRejectedError, match=match):
            server.receive(cid, dataclasses.replace(reply, self_mask_shares=bad))
    with pytest.raises(MessageRejectedError, match="mask-key shares must be for exactly"):
        server.receive(cid, dataclasses.replace(reply, mask_key_shares=(first,)))
    server.receive(cid, reply)


def _deal_inconsistently(rnd: Round, dealer: str, kind: str) -> Any:
    """A tamper hook: ``dealer`` deals shares of its ``kind`` secret from two polynomials
    (half of its neighbours get shares of one, half of another, both of the true
    secret), each sealed properly and committed to. Every share passes every check one
    at a time, but no t of them lie on one polynomial."""

    def hook(stage: Stage, cid: str, reply: Any) -> Any:
        if stage is not Stage.SHARE_KEYS or cid != dealer:
            return reply
        assert isinstance(reply, ShareKeysReply)
        attempt = rnd.clients[dealer]._attempt
        assert attempt is not None and attempt.mask_key is not None
        assert attempt.self_mask_seed is not None
        setup, t = attempt.setup, attempt.setup.threshold
        receivers = [s.receiver for s in reply.shares]
        xs = [setup.x_coordinate(v) for v in receivers]
        secret = private_bytes(attempt.mask_key) if kind == MASK_KEY else attempt.self_mask_seed
        one, other = split(secret, t, xs), split(secret, t, xs)
        mixed = [a if i % 2 else b for i, (a, b) in enumerate(zip(one, other, strict=True))]
        consistent = split(attempt.self_mask_seed if kind == MASK_KEY
                           else private_bytes(attempt.mask_key), t, xs)
        shares, commitments = [], []
        for v, bad, good in zip(receivers, mixed, consistent, strict=True):
            key_share, seed_share = (bad, good) if kind == MASK_KEY else (good, bad)
            key = derive_share_key(attempt.cipher_secrets[v], setup, dealer, v)
            nonce, sealed = seal_share(key, setup, dealer, v, key_share + seed_share,
                                       graph_seed=attempt.graph_seed)
            shares.append(EncryptedShare(dealer, v, nonce, sealed))
            commitments.append(ShareCommitment(
                v, commit_share(setup, dealer, v, MASK_KEY, key_share),
                commit_share(setup, dealer, v, SELF_MASK, seed_share)))
        return dataclasses.replace(reply, shares=tuple(shares),
                                   share_commitments=tuple(commitments))

    return hook


@BOTH_MODES
@pytest.mark.parametrize("kind", [SELF_MASK, MASK_KEY])
def test_a_dealer_of_inconsistent_shares_is_named_a_culprit(authenticated: bool,
                                                            kind: str) -> None:
    """Self-mask shares: the dealer survives and its seed must be reconstructed; mask-key
    shares: it drops after sharing and its mask key must be. Either way no holder can
    tell (each share matches its commitment), and the server blames the dealer."""
    ids = ids_of(12)
    dealer = ids[3]
    rnd = setup_round(CONFIG, make_inputs(ids, 8), authenticated=authenticated)
    drop_at = {dealer: Stage.MASKED_INPUT} if kind == MASK_KEY else {}
    with pytest.raises(SecureAggregationError, match="dealt inconsistent shares"):
        run(rnd, drop_at=drop_at, tamper_reply=_deal_inconsistently(rnd, dealer, kind))
    assert rnd.server.status is SecAggStatus.FAILED
    assert rnd.server.culprits == {dealer}
    assert rnd.refusals == {} and rnd.rejections == {}  # every check passed on the way
    # every holder answered the unmask stage: the server had all the shares there were
    unmasked = {c for _, c, _, r in rnd.transcript if isinstance(r, UnmaskReply)}
    assert rnd.server.graph[dealer] <= unmasked


@BOTH_MODES
def test_an_honest_round_names_no_culprit(authenticated: bool) -> None:
    ids = ids_of(10)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 4), authenticated=authenticated),
              drop_at={ids[1]: Stage.MASKED_INPUT})
    assert rnd.server.culprits == set()
    assert np.isfinite(rnd.server.result.mean).all()
