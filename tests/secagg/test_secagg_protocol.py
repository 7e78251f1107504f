"""The SecAgg+ round on the in-process state machines: correctness and dropouts, in
authenticated attempts (signed keys, a consistency stage) and unauthenticated ones."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from secagg_driver import (
    Round,
    assert_matches_plaintext,
    ids_of,
    make_inputs,
    run,
    setup_round,
)

from fedloom import ClientUpdate, Weights
from fedloom.errors import SecureAggregationError
from fedloom.secagg import (
    SHARE_BYTES,
    AdvertisedKeys,
    MaskedInputReply,
    RoundId,
    SecAggConfig,
    SecAggStatus,
    ShareKeysReply,
    Stage,
    UnmaskReply,
    commit_self_mask,
    private_key_from_bytes,
    public_bytes,
    reconstruct,
    split,
)
from fedloom.secagg._shamir import decode_share, interpolate_at_zero
from fedloom.secagg._unmask import DealerFaultError, reconstruct_checked
from fedloom.strategies import WeightedMeanAggregator

CONFIG = SecAggConfig(enabled=True, neighbours=6, threshold=4, clip_range=3.0, bits=20,
                      max_weight=100.0, max_participants=64)
FULL = SecAggConfig(enabled=True, neighbours=10, threshold=6, clip_range=1.0, bits=20,
                    max_weight=100.0, max_participants=64)

BOTH_MODES = pytest.mark.parametrize("authenticated", [True, False],
                                     ids=["authenticated", "unauthenticated"])


def _retry_without(rnd: Round, gone: list[str], config: SecAggConfig = CONFIG,
                   drop_at: Mapping[str, Stage] | None = None) -> Round:
    """The round driver's answer to a failed attempt: the next attempt, same clients,
    without ``gone``."""
    rid = rnd.server.setup.round_id
    rest = {c: v for c, v in rnd.inputs.items() if c not in gone}
    retry = setup_round(config, rest, RoundId(rid.run_id, rid.server_round, rid.attempt + 1),
                        clients=rnd.clients, authenticated=rnd.server.setup.authenticated)
    return run(retry, drop_at=drop_at)


@BOTH_MODES
def test_round_without_dropouts_equals_the_plaintext_weighted_mean(authenticated: bool) -> None:
    ids = ids_of(10)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 40, scale=2.0), authenticated=authenticated))
    assert rnd.server.status is SecAggStatus.SUCCEEDED
    assert_matches_plaintext(CONFIG, rnd, ids)
    assert rnd.server.result.dropped == ()
    assert rnd.server.result.total_examples == pytest.approx(
        sum(n for _, n in rnd.inputs.values()), abs=10 * CONFIG.max_weight / CONFIG.levels)
    stages = {stage for stage, _, _, _ in rnd.transcript}
    assert (Stage.CONSISTENCY in stages) is authenticated
    keys = [r for _, _, _, r in rnd.transcript if isinstance(r, AdvertisedKeys)]
    assert len(keys) == 10 and all(k.signed is authenticated for k in keys)


@BOTH_MODES
def test_mean_agrees_with_fedlooms_plain_weighted_mean_aggregator(authenticated: bool) -> None:
    """Oracle: the streaming FedAvg aggregator over the clipped deltas, weighted by
    num_examples, gives the same mean to within the quantization error."""
    ids = ids_of(9)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 30, scale=0.5), authenticated=authenticated))
    aggregator = WeightedMeanAggregator()
    aggregator.start(Weights({"w": np.zeros(30)}))
    for cid, (vec, n) in rnd.inputs.items():
        delta = Weights({"w": np.clip(vec, -3.0, 3.0)})
        aggregator.accumulate(ClientUpdate(cid, delta, n, base_round=0))
    plain = aggregator.finalize().delta
    assert plain is not None
    assert np.allclose(rnd.server.result.mean, plain["w"], atol=20 * CONFIG.quantum)


# Where a dropout ends an authenticated attempt: every participant's keys shape its graph
# (advertise_keys), and a survivor's self-mask share is revealed only with that
# survivor's own confirmation (consistency).
ATTEMPT_ENDERS = {Stage.ADVERTISE_KEYS, Stage.CONSISTENCY}
DROPOUT_CASES = [(stage, True) for stage in Stage] + [
    (stage, False) for stage in Stage if stage is not Stage.CONSISTENCY]


@pytest.mark.parametrize(("stage", "authenticated"), DROPOUT_CASES)
@pytest.mark.parametrize("count", [1, 2])
def test_dropouts_at_each_stage(stage: Stage, authenticated: bool, count: int) -> None:
    """``stage`` is the first stage the client does not answer: advertise_keys (never
    joined), share_keys (after advertising keys), masked_input (after sharing keys),
    consistency (after its masked input), unmask (after its masked input and, when
    authenticated, its confirmation: its input stays in the sum)."""
    ids = ids_of(12)
    gone = ids[3 : 3 + count]
    rnd = setup_round(CONFIG, make_inputs(ids, 25, seed=count), authenticated=authenticated)
    if authenticated and stage in ATTEMPT_ENDERS:
        with pytest.raises(SecureAggregationError, match="failed"):
            run(rnd, drop_at=dict.fromkeys(gone, stage))
        assert rnd.server.status is SecAggStatus.FAILED
        assert rnd.server.failed_clients == set(gone)
        rnd = _retry_without(rnd, gone)  # the next attempt, without them, succeeds
        assert_matches_plaintext(CONFIG, rnd, [c for c in ids if c not in gone])
        assert rnd.server.result.dropped == ()
        return
    run(rnd, drop_at=dict.fromkeys(gone, stage))
    survivors = ids if stage is Stage.UNMASK else [c for c in ids if c not in gone]
    assert_matches_plaintext(CONFIG, rnd, survivors)
    masks_removed = tuple(gone) if stage is Stage.MASKED_INPUT else ()
    assert rnd.server.result.dropped == masks_removed


def test_dropouts_at_every_stage_in_one_unauthenticated_round() -> None:
    ids = ids_of(16)
    drops = {ids[1]: Stage.ADVERTISE_KEYS, ids[5]: Stage.SHARE_KEYS,
             ids[9]: Stage.MASKED_INPUT, ids[13]: Stage.UNMASK}
    rnd = run(setup_round(FULL, make_inputs(ids, 20, seed=4), authenticated=False),
              drop_at=drops)
    assert_matches_plaintext(FULL, rnd, [c for c in ids if c not in (ids[1], ids[5], ids[9])])
    assert rnd.server.result.dropped == (ids[9],)


def test_dropouts_at_every_stage_across_the_attempts_of_one_authenticated_round() -> None:
    """Attempt 1 loses a client at advertise_keys, attempt 2 one at consistency (both
    end their attempt); attempt 3, the clients' last (max_attempts = 3), loses one at
    each of share_keys, masked_input and unmask and still finishes."""
    ids = ids_of(16)
    inputs = make_inputs(ids, 20, seed=4)
    first = setup_round(FULL, inputs)
    with pytest.raises(SecureAggregationError, match="did not advertise"):
        run(first, drop_at={ids[1]: Stage.ADVERTISE_KEYS})
    rest = {c: v for c, v in inputs.items() if c != ids[1]}
    second = setup_round(FULL, rest, RoundId("run-1", 1, 2), clients=first.clients)
    with pytest.raises(SecureAggregationError, match="did not confirm"):
        run(second, drop_at={ids[3]: Stage.CONSISTENCY})
    third = _retry_without(second, [ids[3]], FULL,
                           drop_at={ids[5]: Stage.SHARE_KEYS, ids[9]: Stage.MASKED_INPUT,
                                    ids[13]: Stage.UNMASK})
    assert third.server.setup.round_id == RoundId("run-1", 1, 3)
    assert_matches_plaintext(FULL, third, [c for c in ids if c not in (ids[1], ids[3], ids[5],
                                                                       ids[9])])
    assert third.server.result.dropped == (ids[9],)


@pytest.mark.parametrize(("stage", "authenticated"),
                         [c for c in DROPOUT_CASES if c[0] is not Stage.ADVERTISE_KEYS])
def test_too_few_survivors_fail_cleanly(stage: Stage, authenticated: bool) -> None:
    ids = ids_of(8)
    rnd = setup_round(CONFIG, make_inputs(ids, 10), authenticated=authenticated)
    with pytest.raises(SecureAggregationError, match="failed"):
        run(rnd, drop_at=dict.fromkeys(ids[:4], stage))
    assert rnd.server.status is SecAggStatus.FAILED and rnd.server.failure
    with pytest.raises(SecureAggregationError, match="no result"):
        _ = rnd.server.result


def _pruned(graph: Mapping[str, frozenset[str]], alive: set[str], t: int) -> set[str]:
    """Reference: drop clients with fewer than t live neighbours until none is short."""
    while short := {u for u in alive if len(graph[u] & alive) < t}:
        alive = alive - short
    return alive


@BOTH_MODES
def test_clients_with_too_few_neighbours_left_are_pruned_not_fatal(authenticated: bool) -> None:
    """k = 6, t = 4: three neighbours of one client do not share keys, so its secrets
    cannot be shared t-of-k among those left; the server leaves it out and the others
    finish. (The graph comes from fresh keys; on a ring-like one, some triples of
    neighbours would start a cascade that prunes everyone, so a triple whose pruning
    keeps at least 20 clients is picked, in a new attempt if none does.)"""
    ids = ids_of(30)
    for attempt in range(1, 6):  # about 2% of these graphs have no such triple
        rnd = run(setup_round(CONFIG, make_inputs(ids, 10), RoundId("run-1", 1, attempt),
                              authenticated=authenticated), stop_at=Stage.SHARE_KEYS)
        graph, victim = rnd.server.graph, ids[0]
        choices = [set(gone) for gone in itertools.combinations(sorted(graph[victim]), 3)
                   if len(_pruned(graph, set(ids) - set(gone), 4)) >= 20]
        if choices:
            break
    assert choices, "five graphs in a row without a triple that prunes few clients"
    gone = choices[0]
    expected = _pruned(graph, set(ids) - gone, 4)
    assert victim not in expected
    run(rnd, drop_at=dict.fromkeys(gone, Stage.SHARE_KEYS))
    survivors = rnd.server.result.survivors
    assert survivors == tuple(sorted(expected))
    assert victim not in rnd.refusals  # it was simply not asked for its masked input
    assert victim not in rnd.server.result.dropped  # nobody masked against it
    assert victim in rnd.server.failed_clients
    assert_matches_plaintext(CONFIG, rnd, survivors)


def _unmask_shares(rnd: Round, kind: str) -> dict[str, dict[int, bytes]]:
    out: dict[str, dict[int, bytes]] = {}
    for _, cid, _, reply in rnd.transcript:
        if isinstance(reply, UnmaskReply):
            x = rnd.server.setup.x_coordinate(cid)
            for share in getattr(reply, kind):
                out.setdefault(share.owner, {})[x] = share.value
    return out


@BOTH_MODES
def test_every_threshold_sized_subset_of_revealed_shares_reconstructs(
        authenticated: bool) -> None:
    """k = 10, t = 6 over 11 clients (each neighbours all 10 others); one client drops
    after sharing keys. Its mask key is reconstructed from each of the 210 six-subsets
    of the 10 survivors' shares, a survivor's self-mask seed from each of the 84
    six-subsets of its 9 surviving neighbours' shares; no five-subset reconstructs."""
    ids = ids_of(11)
    rnd = run(setup_round(FULL, make_inputs(ids, 8), authenticated=authenticated),
              drop_at={ids[0]: Stage.MASKED_INPUT})
    setup = rnd.server.setup
    keys = {r.client_id: r for _, _, _, r in rnd.transcript if isinstance(r, AdvertisedKeys)}
    commitments = {r.client_id: r.self_mask_commitment
                   for _, _, _, r in rnd.transcript if isinstance(r, ShareKeysReply)}
    key_shares = _unmask_shares(rnd, "mask_key_shares")[ids[0]]
    seed_shares = _unmask_shares(rnd, "self_mask_shares")[ids[1]]
    assert len(key_shares) == 10 and len(seed_shares) == 9

    def is_key(secret: bytes) -> bool:
        return public_bytes(private_key_from_bytes(secret)) == keys[ids[0]].mask_public_key

    def is_seed(secret: bytes) -> bool:
        return commit_self_mask(setup, ids[1], secret) == commitments[ids[1]]

    for shares, check, size in ((key_shares, is_key, 210), (seed_shares, is_seed, 84)):
        subsets = list(itertools.combinations(sorted(shares.items()), 6))
        assert len(subsets) == size
        for subset in subsets:
            reconstruct_checked(dict(subset), 6, check, "test")
        for subset in itertools.combinations(sorted(shares.items()), 5):
            with pytest.raises(SecureAggregationError):
                reconstruct_checked(dict(subset), 6, check, "test")
    assert_matches_plaintext(FULL, rnd, ids[1:])


def test_a_reconstruction_is_kept_only_if_it_is_the_committed_secret() -> None:
    """t shares that are a valid sharing of another secret than the owner committed to
    (a dealer that shared one seed and committed to another) must not be used to
    unmask: the check rejects every subset and the owner is named. With one share of a
    second polynomial among t + 1, the subsets are searched until one reconstructs the
    committed secret."""
    committed, other = bytes(range(32)), bytes(range(1, 33))

    def is_committed(secret: bytes) -> bool:
        return secret == committed

    xs = [1, 2, 3, 4]
    shares = dict(zip(xs, split(other, 3, xs), strict=True))
    with pytest.raises(DealerFaultError, match="'dealer' dealt inconsistent shares") as fault:
        reconstruct_checked(shares, 3, is_committed, "self-mask seed of 'dealer'", "dealer")
    assert fault.value.owner == "dealer"
    # x = 2, 3, 4 share `committed`; the share at x = 1 lies on the polynomial through
    # (0, other), (2, f(2)), (3, f(3)): the first subset {1, 2, 3} reconstructs `other`
    f = dict(zip(xs, (decode_share(v) for v in split(committed, 3, xs)), strict=True))
    through = [(0 - 1, int.from_bytes(other, "big")), (2 - 1, f[2]), (3 - 1, f[3])]
    mixed = {x: f[x].to_bytes(SHARE_BYTES, "big") for x in (2, 3, 4)}
    mixed[1] = interpolate_at_zero(through).to_bytes(SHARE_BYTES, "big")  # h(1)
    assert reconstruct([(x, mixed[x]) for x in (1, 2, 3)], 3) == other
    assert reconstruct_checked(mixed, 3, is_committed, "seed", "dealer") == committed


@BOTH_MODES
def test_restarted_round_uses_a_new_attempt_and_fresh_masks(authenticated: bool) -> None:
    ids = ids_of(8)
    inputs = make_inputs(ids, 16)
    first = setup_round(CONFIG, inputs, authenticated=authenticated)
    # the attempt fails late, before any share is revealed: too few masked inputs
    with pytest.raises(SecureAggregationError, match="masked inputs"):
        run(first, drop_at=dict.fromkeys(ids[:5], Stage.MASKED_INPUT))
    assert not first.server.revealed
    second = _retry_without(first, [])
    assert second.server.setup.round_id.attempt == first.server.setup.round_id.attempt + 1
    assert_matches_plaintext(CONFIG, second, ids)

    def sent(rnd: Round, kind: type) -> dict[str, Any]:
        return {c: r for _, c, _, r in rnd.transcript if isinstance(r, kind)}

    a, b = sent(first, AdvertisedKeys), sent(second, AdvertisedKeys)
    for cid in ids:
        assert a[cid].mask_public_key != b[cid].mask_public_key
        assert a[cid].cipher_public_key != b[cid].cipher_public_key
    ca, cb = sent(first, ShareKeysReply), sent(second, ShareKeysReply)
    for cid in ids:
        assert ca[cid].self_mask_commitment != cb[cid].self_mask_commitment
    ma, mb = sent(first, MaskedInputReply), sent(second, MaskedInputReply)
    assert sorted(ma) == ids[5:]
    for cid in ma:  # same input, unrelated masked vectors
        assert (ma[cid].masked != mb[cid].masked).mean() > 0.9


@BOTH_MODES
def test_after_an_attempt_that_revealed_shares_a_retry_goes_on_without_them(
        authenticated: bool) -> None:
    """An attempt that fails in unmask (5 of 8 gone there: too few shares) has revealed
    the shares of the 3 that answered: they take part in no other attempt of the round
    (`SecAggServer.revealed`). The retry runs over the 5 others; a server that asks the
    3 again is refused by each of them."""
    ids = ids_of(8)
    inputs = make_inputs(ids, 16)
    first = setup_round(CONFIG, inputs, authenticated=authenticated)
    with pytest.raises(SecureAggregationError):
        run(first, drop_at=dict.fromkeys(ids[:5], Stage.UNMASK))
    assert first.server.revealed == set(ids[5:])
    second = _retry_without(first, sorted(first.server.revealed))
    assert_matches_plaintext(CONFIG, second, ids[:5])
    rid = second.server.setup.round_id
    again = setup_round(CONFIG, inputs, RoundId(rid.run_id, rid.server_round, rid.attempt + 1),
                        clients=first.clients, authenticated=authenticated)
    with contextlib.suppress(SecureAggregationError):
        run(again)
    assert all("may be in the sum of an earlier attempt" in again.refusals[c] for c in ids[5:])


@BOTH_MODES
def test_identical_retries_are_idempotent_on_both_sides(authenticated: bool) -> None:
    ids = ids_of(8)
    rnd = setup_round(CONFIG, make_inputs(ids, 12), authenticated=authenticated)
    server = rnd.server
    stages = []
    while server.status is SecAggStatus.RUNNING:
        stages.append(server.stage)
        for cid in sorted(server.pending()):
            request = server.request_for(cid)
            vec, n = rnd.inputs[cid]
            reply = rnd.clients[cid].handle(request, vector=vec, num_examples=n)
            again = rnd.clients[cid].handle(request, vector=vec, num_examples=n)
            assert again is reply  # the cached reply, nothing recomputed or re-revealed
            server.receive(cid, reply)
            server.receive(cid, reply)  # a retried push: not counted twice
        server.advance()
    assert (Stage.CONSISTENCY in stages) is authenticated
    assert_matches_plaintext(CONFIG, rnd, ids)


@BOTH_MODES
def test_unmask_can_finish_early_once_every_secret_has_t_shares(authenticated: bool) -> None:
    ids = ids_of(12)
    rnd = run(setup_round(CONFIG, make_inputs(ids, 10), authenticated=authenticated),
              stop_at=Stage.UNMASK)
    server = rnd.server
    assert server.stage is Stage.UNMASK and not server.can_finish()
    answered = 0
    for cid in sorted(server.pending()):
        if server.can_finish():
            break
        server.receive(cid, rnd.clients[cid].handle(server.request_for(cid)))
        answered += 1
    assert server.can_finish() and answered < len(ids)
    server.advance()
    assert_matches_plaintext(CONFIG, rnd, ids)


@BOTH_MODES
def test_a_weight_claim_above_max_weight_is_refused_by_the_client(authenticated: bool) -> None:
    ids = ids_of(10)
    inputs = make_inputs(ids, 10)
    inputs[ids[2]] = (inputs[ids[2]][0], 101)  # max_weight is 100
    rnd = run(setup_round(CONFIG, inputs, authenticated=authenticated))
    assert "max_weight" in rnd.refusals[ids[2]]
    assert_matches_plaintext(CONFIG, rnd, [c for c in ids if c != ids[2]])
