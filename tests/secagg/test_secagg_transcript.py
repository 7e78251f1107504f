"""The server's transcript of a round does not reveal any one client's input.

Everything below is computed from the transcript alone (what the server sent and
received): the setup, the advertised keys, the relayed ciphertexts, the masked inputs
and the unmask replies. The server legitimately learns every survivor's self-mask
seed and every dropped client's mask key; what it cannot remove from a survivor's
masked input are the pairwise masks shared with other survivors.
"""

from __future__ import annotations

import numpy as np
import pytest
from secagg_driver import Round, ids_of, make_inputs, plaintext_mean, run, setup_round

from fedloom.errors import SecureAggregationError
from fedloom.secagg import (
    AdvertisedKeys,
    AdvertiseKeysRequest,
    MaskedInputReply,
    MaskExpander,
    RoundId,
    SecAggConfig,
    ShareKeysReply,
    ShareKeysRequest,
    Stage,
    UnmaskReply,
    agree,
    commit_self_mask,
    dequantize,
    derive_mask_seed,
    graph_seed,
    neighbour_graph,
    private_key_from_bytes,
    public_bytes,
    quantize,
)
from fedloom.secagg._unmask import matches_public_key, reconstruct_checked

CONFIG = SecAggConfig(enabled=True, neighbours=6, threshold=4, clip_range=1.0, bits=20,
                      max_weight=100.0, max_participants=64)
LENGTH = 4096
VICTIM = "client-005"


#: (authenticated, on key offers): the three ways a round can run
MODES = pytest.mark.parametrize(("authenticated", "on_offers"),
                                [(True, False), (False, False), (False, True)],
                                ids=["authenticated", "unauthenticated", "on-offers"])


def _round(victim_value: float, attempt: int = 0, on_offers: bool = False,
           authenticated: bool = True) -> Round:
    """One round in which the victim's first neighbour drops after sharing keys (the
    graph comes from the clients' fresh keys, so the dropout is picked once it is
    known); ``on_offers``: after a first (unauthenticated) round, on the keys the
    clients offered in it (no advertise stage)."""
    ids = ids_of(10)
    inputs = make_inputs(ids, LENGTH, seed=attempt)
    inputs[VICTIM] = (np.full(LENGTH, victim_value), 100)
    clients, offers = None, None
    if on_offers:
        first = run(setup_round(CONFIG, make_inputs(ids, LENGTH, seed=99),
                                round_id=RoundId("run-1", 0, attempt), authenticated=False))
        clients, offers = first.clients, first.server.new_offers
    rnd = setup_round(CONFIG, inputs, round_id=RoundId("run-1", 1, attempt), clients=clients,
                      offers=offers, authenticated=authenticated)
    run(rnd, stop_at=Stage.SHARE_KEYS)
    return run(rnd, drop_at={min(rnd.server.graph[VICTIM]): Stage.MASKED_INPUT})


def _server_view_residual(rnd: Round, victim: str) -> np.ndarray:
    """y_victim minus every mask the transcript lets the server remove."""
    requests = [r for _, _, r, _ in rnd.transcript]
    setup = next(r.setup for r in requests if isinstance(r, AdvertiseKeysRequest | ShareKeysRequest)
                 and r.setup is not None)
    # every member's keys travel in each share-keys request (offered keys included); the
    # graph is derived from them, as each client derives it
    roster = next(r.roster for r in requests if isinstance(r, ShareKeysRequest))
    keys = {k.client_id: k for k in roster}
    graph = neighbour_graph(keys, setup.neighbours, graph_seed(setup, roster))
    assert graph == rnd.server.graph
    commitments = {r.client_id: r.self_mask_commitment
                   for _, _, _, r in rnd.transcript if isinstance(r, ShareKeysReply)}
    masked = {r.client_id: r.masked for _, _, _, r in rnd.transcript
              if isinstance(r, MaskedInputReply)}
    seed_shares: dict[str, dict[int, bytes]] = {}
    key_shares: dict[str, dict[int, bytes]] = {}
    for _, cid, _, reply in rnd.transcript:
        if isinstance(reply, UnmaskReply):
            x = setup.x_coordinate(cid)
            for s in reply.self_mask_shares:
                seed_shares.setdefault(s.owner, {})[x] = s.value
            for s in reply.mask_key_shares:
                key_shares.setdefault(s.owner, {})[x] = s.value
    # the transcript holds no mask-key share of any survivor, no seed share of a dropout
    assert not set(key_shares) & set(masked)
    assert set(seed_shares) <= set(masked)
    residual = masked[victim].copy()
    expander = MaskExpander(setup.masked_length)
    seed = reconstruct_checked(
        seed_shares[victim], setup.threshold,
        lambda b: commit_self_mask(setup, victim, b) == commitments[victim],
        "seed")
    expander.subtract_from(residual, seed)
    for u, shares in key_shares.items():
        if u not in graph[victim]:
            continue
        key = private_key_from_bytes(reconstruct_checked(
            shares, setup.threshold, matches_public_key(keys[u].mask_public_key), "key"))
        pair = derive_mask_seed(agree(key, keys[victim].mask_public_key), setup, u, victim)
        if victim < u:
            expander.subtract_from(residual, pair)
        else:
            expander.add_to(residual, pair)
    # the survivors' pairwise masks with the victim cannot be removed: their mask keys
    # were never revealed, so reconstruction fails for every one of them
    for v in graph[victim] & set(masked):
        with pytest.raises(SecureAggregationError, match="0 shares revealed"):
            reconstruct_checked(key_shares.get(v, {}), setup.threshold, lambda s: True, "key")
    return residual


def _top_byte_chi2(values: np.ndarray) -> float:
    counts = np.bincount((values >> 24).astype(np.int64), minlength=256)
    expected = len(values) / 256
    return float(((counts - expected) ** 2 / expected).sum())


@MODES
def test_residual_after_removing_all_removable_masks_hides_the_input(
        authenticated: bool, on_offers: bool) -> None:
    rnd = _round(0.0, on_offers=on_offers, authenticated=authenticated)
    assert any(isinstance(r, AdvertiseKeysRequest) for _, _, r, _ in rnd.transcript) != on_offers
    result = rnd.server.result
    assert VICTIM in result.survivors and len(result.dropped) == 1
    assert result.dropped[0] in rnd.server.graph[VICTIM]  # one pairwise mask is removable
    residuals = {v: _server_view_residual(rnd, v) for v in result.survivors}
    # the server's view is right: its residuals add up to the (decoded) sum it outputs
    total = np.zeros(LENGTH + 1, np.uint32)
    for r in residuals.values():
        np.add(total, r, out=total)
    weighted, _ = dequantize(total, len(result.survivors), CONFIG.clip_range, CONFIG.bits)
    _, expected, _ = plaintext_mean(CONFIG, rnd.inputs, result.survivors)
    assert np.abs(weighted - expected).max() <= len(result.survivors) * CONFIG.quantum
    # yet no single residual is a quantized input: every quantized value is below 2**20,
    # a residual lands there about 4097 * 2**-12 = 1 times, and is uniform
    for v, residual in residuals.items():
        assert int((residual < 2**CONFIG.bits).sum()) < 12, v
        assert _top_byte_chi2(residual) < 400, v  # 255 dof, p < 1e-8 beyond 400
    plain = quantize(np.zeros(LENGTH), 1.0, 1.0, CONFIG.bits, np.random.default_rng(0))
    assert not np.array_equal(residuals[VICTIM][:-1] >> 20, plain[:-1] >> 20)


@pytest.mark.parametrize("authenticated", [True, False],
                         ids=["authenticated", "unauthenticated"])
def test_masked_inputs_of_different_inputs_are_identically_distributed(
        authenticated: bool) -> None:
    """The victim contributes all -1 in one attempt and all +1 in another (the extreme
    ends of the clip range); its masked vectors are both uniform, and a two-sample
    chi-square test on their top bytes does not tell them apart."""
    low = next(r.masked for _, c, _, r in _round(-1.0, attempt=0,
                                                 authenticated=authenticated).transcript
               if c == VICTIM and isinstance(r, MaskedInputReply))
    high = next(r.masked for _, c, _, r in _round(1.0, attempt=1,
                                                  authenticated=authenticated).transcript
                if c == VICTIM and isinstance(r, MaskedInputReply))
    a = np.bincount((low >> 24).astype(np.int64), minlength=256).astype(float)
    b = np.bincount((high >> 24).astype(np.int64), minlength=256).astype(float)
    two_sample = float((((a - b) ** 2) / np.maximum(a + b, 1)).sum())
    assert two_sample < 400
    assert _top_byte_chi2(low) < 400 and _top_byte_chi2(high) < 400
    # while the unmasked quantized inputs are worlds apart
    q_low = quantize(np.full(LENGTH, -1.0), 1.0, 1.0, CONFIG.bits, np.random.default_rng(0))
    q_high = quantize(np.full(LENGTH, 1.0), 1.0, 1.0, CONFIG.bits, np.random.default_rng(0))
    assert (q_high[:-1] - q_low[:-1] == 2**CONFIG.bits - 1).all()


@pytest.mark.parametrize("authenticated", [True, False],
                         ids=["authenticated", "unauthenticated"])
def test_t_minus_1_colluding_neighbours_cannot_unmask_a_survivor(authenticated: bool) -> None:
    """t - 1 = 3 of the victim's neighbours pool the shares they hold with the server's
    transcript: the victim's mask key stays out of reach."""
    ids = ids_of(10)
    rnd = setup_round(CONFIG, make_inputs(ids, 64), authenticated=authenticated)
    run(rnd, stop_at=Stage.UNMASK)
    server = rnd.server
    colluders = sorted(server.graph[VICTIM])[: CONFIG.threshold - 1]
    pooled = {server.setup.x_coordinate(c): rnd.clients[c]._attempt.held[VICTIM][0]  # type: ignore[union-attr]
              for c in colluders}
    keys = {r.client_id: r for _, _, _, r in rnd.transcript if isinstance(r, AdvertisedKeys)}
    assert len(pooled) == CONFIG.threshold - 1
    with pytest.raises(SecureAggregationError):
        reconstruct_checked(pooled, CONFIG.threshold,
                            lambda s: public_bytes(private_key_from_bytes(s))
                            == keys[VICTIM].mask_public_key, "collusion")
    # nor by pretending the threshold were t - 1 (the interpolation misses the secret)
    with pytest.raises(SecureAggregationError):
        reconstruct_checked(pooled, CONFIG.threshold - 1,
                            lambda s: public_bytes(private_key_from_bytes(s))
                            == keys[VICTIM].mask_public_key, "collusion")
    run(rnd)  # the round itself still completes
    assert VICTIM in rnd.server.result.survivors
