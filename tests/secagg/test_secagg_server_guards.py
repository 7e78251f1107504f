"""The server drops bad replies without crashing the round (authenticated and
unauthenticated attempts)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from clients_defend_support import BOTH_MODES, CONFIG
from secagg_driver import (
    SMALL_ORDER,
    Hook,
    Round,
    close_masked_input,
    ids_of,
    make_inputs,
    run,
    setup_round,
)

from fedloom.errors import MessageRejectedError, RejectReason, SecureAggregationError
from fedloom.secagg import (
    AdvertisedKeys,
    KeyOffer,
    MaskedInputReply,
    RoundId,
    SecAggStatus,
    ShareKeysReply,
    Stage,
    UnmaskReply,
    is_connected,
)

Graph = Mapping[str, frozenset[str]]



def _bad_masked(how: str) -> Hook:
    def hook(stage: Stage, cid: str, reply: Any) -> Any:
        if stage is not Stage.MASKED_INPUT or cid != "client-003":
            return reply
        masked = reply.masked
        if how == "short":
            return MaskedInputReply(reply.round_id, cid, masked[:-1])
        if how == "long":
            return MaskedInputReply(reply.round_id, cid, np.append(masked, np.uint32(7)))
        if how == "dtype":
            return MaskedInputReply(reply.round_id, cid, masked.astype(np.int64))
        if how == "2d":
            return MaskedInputReply(reply.round_id, cid, masked.reshape(1, -1))
        if how == "round":
            return MaskedInputReply(RoundId("run-1", 2, 0), cid, masked)
        if how == "attempt":
            return MaskedInputReply(RoundId("run-1", 1, 2), cid, masked)
        if how == "impersonation":
            return MaskedInputReply(reply.round_id, "client-004", masked)
        raise AssertionError(how)
    return hook


@BOTH_MODES
@pytest.mark.parametrize(
    ("how", "reason"),
    [("short", "invalid"), ("long", "invalid"), ("dtype", "invalid"), ("2d", "invalid"),
     ("round", "stale"), ("attempt", "stale"), ("impersonation", "forbidden")],
)
def test_bad_masked_input_is_dropped_and_the_round_completes(how: str, reason: str,
                                                             authenticated: bool) -> None:
    ids = ids_of(10)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 9), authenticated=authenticated),
              tamper_reply=_bad_masked(how))
    assert rnd.rejections["client-003"].startswith(reason)
    assert "client-003" not in rnd.server.result.survivors
    assert rnd.server.result.dropped == ("client-003",)
    assert len(rnd.server.result.survivors) == 9


@BOTH_MODES
def test_rejection_reasons(authenticated: bool) -> None:
    ids = ids_of(8)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 5), authenticated=authenticated),
              stop_at=Stage.MASKED_INPUT)
    server = rnd.server
    cid = ids[0]
    vec, n = rnd.inputs[cid]
    reply = rnd.clients[cid].handle(server.request_for(cid), vector=vec, num_examples=n)
    assert isinstance(reply, MaskedInputReply)

    def reason_of(client_id: str, message: Any) -> RejectReason:
        with pytest.raises(MessageRejectedError) as info:
            server.receive(client_id, message)
        return info.value.reason

    short = MaskedInputReply(reply.round_id, cid, reply.masked[:-1])
    assert reason_of(cid, short) is RejectReason.INVALID
    assert reason_of(ids[1], reply) is RejectReason.FORBIDDEN  # in another's name
    stale = MaskedInputReply(RoundId("run-1", 0, 0), cid, reply.masked)
    assert reason_of(cid, stale) is RejectReason.STALE
    wrong_stage = UnmaskReply(reply.round_id, cid, (), ())
    assert reason_of(cid, wrong_stage) is RejectReason.STALE
    server.receive(cid, reply)
    server.receive(cid, reply)  # identical retry: fine
    changed = MaskedInputReply(reply.round_id, cid, reply.masked ^ np.uint32(1))
    assert reason_of(cid, changed) is RejectReason.CONFLICT
    late_request = server.request_for(ids[1])
    late = rnd.clients[ids[1]].handle(late_request, vector=rnd.inputs[ids[1]][0],
                                      num_examples=rnd.inputs[ids[1]][1])
    server.drop(ids[1])  # its stream ended before the reply arrived
    assert reason_of(ids[1], late) is RejectReason.STALE
    for c in sorted(server.pending()):
        v, k = rnd.inputs[c]
        server.receive(c, rnd.clients[c].handle(server.request_for(c), vector=v,
                                                num_examples=k))
    server.advance()  # survivors published: no masked input is taken any more
    assert reason_of(cid, reply) is RejectReason.STALE


@BOTH_MODES
def test_stale_keys_and_shares_are_rejected(authenticated: bool) -> None:
    ids = ids_of(8)
    rnd = setup_round(CONFIG, make_inputs(ids, 5), authenticated=authenticated)
    server = rnd.server
    keys = [rnd.clients[c].handle(server.request_for(c)) for c in ids]
    for c, k in zip(ids, keys, strict=True):
        server.receive(c, k)
    first, second = keys[0], keys[1]
    assert isinstance(first, AdvertisedKeys) and isinstance(second, AdvertisedKeys)
    with pytest.raises(MessageRejectedError) as info:
        server.receive(ids[1], dataclasses.replace(second, mask_public_key=first.mask_public_key))
    assert info.value.reason is RejectReason.CONFLICT  # ids[1] already answered differently
    server.advance()
    share = rnd.clients[ids[0]].handle(server.request_for(ids[0]))
    assert isinstance(share, ShareKeysReply)
    missing_one = ShareKeysReply(share.round_id, share.client_id, share.shares[1:],
                                 share.self_mask_commitment, share.share_commitments[1:])
    with pytest.raises(MessageRejectedError, match="exactly the client's neighbours") as info:
        server.receive(ids[0], missing_one)
    assert info.value.reason is RejectReason.INVALID
    short = dataclasses.replace(share.shares[0], ciphertext=share.shares[0].ciphertext[:-1])
    with pytest.raises(MessageRejectedError, match="wrong sender or size") as info:
        server.receive(ids[0], dataclasses.replace(share, shares=(short, *share.shares[1:])))
    assert info.value.reason is RejectReason.INVALID
    server.receive(ids[0], share)  # the honest reply is still taken


@BOTH_MODES
def test_duplicate_public_keys_across_clients_are_rejected(authenticated: bool) -> None:
    ids = ids_of(8)
    rnd = setup_round(CONFIG, make_inputs(ids, 5), authenticated=authenticated)
    server = rnd.server
    first = rnd.clients[ids[0]].handle(server.request_for(ids[0]))
    second = rnd.clients[ids[1]].handle(server.request_for(ids[1]))
    assert isinstance(first, AdvertisedKeys) and isinstance(second, AdvertisedKeys)
    server.receive(ids[0], first)
    copied = dataclasses.replace(second, cipher_public_key=first.cipher_public_key)
    with pytest.raises(MessageRejectedError) as info:
        server.receive(ids[1], copied)
    assert info.value.reason is RejectReason.INVALID
    server.receive(ids[1], second)  # the client's own keys are still welcome


# u = 0 and u = 1 are points of small order on Curve25519: every agreement with them
# gives the all-zero secret, so an honest neighbour would refuse the whole attempt.


@BOTH_MODES
@pytest.mark.parametrize("bad", SMALL_ORDER)
def test_an_advertised_key_of_small_order_is_refused_before_neighbours_see_it(
        bad: bytes, authenticated: bool) -> None:
    ids = ids_of(8)
    rnd = setup_round(CONFIG, make_inputs(ids, 5), authenticated=authenticated)
    keys = rnd.clients[ids[0]].handle(rnd.server.request_for(ids[0]))
    assert isinstance(keys, AdvertisedKeys)
    with pytest.raises(MessageRejectedError, match="small order") as info:
        rnd.server.receive(ids[0], dataclasses.replace(keys, mask_public_key=bad))
    assert info.value.reason is RejectReason.INVALID
    rnd.server.receive(ids[0], keys)  # the honest reply is still taken


@pytest.mark.parametrize("bad", SMALL_ORDER)
def test_a_key_offer_of_small_order_is_refused_and_not_kept(bad: bytes) -> None:
    ids = ids_of(8)  # offers: unauthenticated attempts only
    rnd = run(setup_round(CONFIG, make_inputs(ids, 5), authenticated=False),
              stop_at=Stage.SHARE_KEYS)
    share = rnd.clients[ids[0]].handle(rnd.server.request_for(ids[0]))
    assert isinstance(share, ShareKeysReply) and share.next_keys is not None
    spoiled = dataclasses.replace(share, next_keys=KeyOffer(share.next_keys.cipher_public_key,
                                                            bad))
    with pytest.raises(MessageRejectedError, match="small order"):
        rnd.server.receive(ids[0], spoiled)
    assert ids[0] not in rnd.server.new_offers


# -- a secret too few holders survive to rebuild ----------------------------------------


def _holders(graph: Graph, owner: str, alive: set[str]) -> int:
    return len(graph[owner] & alive)


Plan = tuple[str, tuple[str, ...], tuple[str, ...]]


def _round_with_plan(secret: str, authenticated: bool) -> tuple[Round, Plan]:
    """A round of 20 clients open at masked_input, and a `_plan` on its graph. The graph
    comes from the clients' fresh keys; on some graphs (a circulant graph looks the same
    from every client) no plan exists, and a new round draws another (bounded)."""
    for _ in range(30):
        rnd = run(setup_round(CONFIG, make_inputs(ids_of(20), 8), authenticated=authenticated),
                  stop_at=Stage.MASKED_INPUT)
        plan = _plan(rnd.server.graph, secret)
        if plan is not None:
            return rnd, plan
    raise AssertionError(f"no graph in 30 rounds lets only one {secret} fall short")


def _plan(graph: Graph, secret: str) -> Plan | None:
    """(owner, vanish_before, vanish_after): clients that vanish before their masked
    input and right after it, so that ``owner``'s ``secret`` keeps exactly t - 1 holders
    (t with one vanished client fewer) while every other secret keeps at least t, and
    the survivors stay connected and above the floor. A deterministic search."""
    t, everyone = CONFIG.threshold, set(graph)
    for owner in sorted(graph):
        for cut in itertools.combinations(sorted(graph[owner]), CONFIG.neighbours - t + 1):
            plans: list[tuple[tuple[str, ...], tuple[str, ...]]]
            if secret == "self-mask seed":  # the owner survives; some neighbours vanish
                plans = [(cut, ()), (cut[:-1], ())]
            else:  # the owner vanishes; neighbours vanish right after their input
                plans = [((owner,), cut), ((owner,), cut[:-1])]
            if all(_fits(graph, owner, set(b), set(a), t, everyone) for b, a in plans):
                return owner, plans[0][0], plans[0][1]
    return None


def _fits(graph: Graph, owner: str, before: set[str], after: set[str], t: int,
          everyone: set[str]) -> bool:
    survivors = everyone - before
    alive = survivors - after
    # every survivor's self-mask seed, and the mask key of every vanished client that a
    # survivor masked against
    needed = survivors | {u for u in before if graph[u] & survivors}
    short = {v for v in needed if _holders(graph, v, alive) < t}
    return (len(survivors) >= CONFIG.threshold + 1 and is_connected(graph, survivors)
            and short <= {owner})




@BOTH_MODES
@pytest.mark.parametrize("secret", ["self-mask seed", "mask key"])
def test_an_attempt_whose_secret_cannot_be_rebuilt_fails_before_any_share_is_revealed(
        secret: str, authenticated: bool) -> None:
    """A survivor's self-mask seed, or a dropped client's mask key, with t - 1 holders
    left: the server gives up at the close of masked_input, before it asks anyone to
    reveal a share (its unmask could not succeed); with t holders it goes on."""
    rnd, (owner, before, after) = _round_with_plan(secret, authenticated)
    t = CONFIG.threshold
    with pytest.raises(SecureAggregationError) as failed:
        close_masked_input(rnd, before, after)
    why = (f"the {secret} of {owner!r} cannot be recovered: {t - 1} of its neighbours "
           f"survive, the threshold is {t}")
    assert str(failed.value).endswith(why) and rnd.server.failure == why
    assert rnd.server.status is SecAggStatus.FAILED
    assert rnd.server.stage is Stage.MASKED_INPUT and not rnd.server.pending()


@BOTH_MODES
@pytest.mark.parametrize("secret", ["self-mask seed", "mask key"])
def test_an_attempt_whose_secrets_keep_t_holders_goes_on(secret: str,
                                                         authenticated: bool) -> None:
    rnd, (_, before, after) = _round_with_plan(secret, authenticated)
    if secret == "self-mask seed":
        before = before[:-1]  # one vanished client fewer
    else:
        after = after[:-1]
    close_masked_input(rnd, before, after)
    assert rnd.server.status is SecAggStatus.RUNNING
    assert rnd.server.stage is (Stage.CONSISTENCY if authenticated else Stage.UNMASK)
