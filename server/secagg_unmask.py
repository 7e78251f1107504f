"""The server's last SecAgg+ step: remove the masks from the sum and decode it.

Bonawitz et al. (CCS 2017), round 4. The server holds ``sum of y_v`` over the survivors
``v`` (mod 2**32), where ``y_v = q(x_v) + PRG(b_v) + sum_u +-PRG(s_vu)``. Pairwise masks
between two survivors cancel in the sum. What remains is removed with the secrets the
survivors revealed:

- each survivor's self-mask seed ``b_v`` (reconstructed from t shares, checked against
  the commitment ``v`` advertised): subtract ``PRG(b_v)``;
- each dropped client's mask key ``s_u`` (reconstructed, checked against its advertised
  public key): recompute ``s_uv`` with every surviving neighbour ``v`` and take back the
  mask ``v`` added against ``u``.

Each seed is expanded once, into one reused buffer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping

import numpy as np

from fedloom.errors import SecureAggregationError
from fedloom.secagg import (
    AdvertisedKeys,
    MaskExpander,
    RoundSetup,
    agree,
    commit_self_mask,
    derive_mask_seed,
    private_key_from_bytes,
    public_bytes,
    reconstruct,
)

#: How many threshold-sized subsets to try when a reconstruction fails its check
#: (a neighbour sent a wrong share); each try costs t field inversions.
MAX_SUBSETS = 64


def reconstruct_checked(shares: Mapping[int, bytes], threshold: int,
                        check: Callable[[bytes], bool], what: str) -> bytes:
    """Reconstruct a secret from ``{x: share}`` and accept it only if ``check`` passes.

    With more than ``threshold`` shares, other subsets are tried when the first fails,
    so one wrong share does not sink the round.
    """
    points = sorted(shares.items())
    if len(points) < threshold:
        raise SecureAggregationError(
            f"{what}: {len(points)} shares revealed, the threshold is {threshold}")
    for subset in itertools.islice(itertools.combinations(points, threshold), MAX_SUBSETS):
        try:
            secret = reconstruct(subset, threshold)
        except SecureAggregationError:
            continue
        if check(secret):
            return secret
    raise SecureAggregationError(f"{what}: the revealed shares do not reconstruct the secret "
                                 "that was committed to (a neighbour sent wrong shares)")


def matches_commitment(setup: RoundSetup, owner: str,
                       commitment: bytes) -> Callable[[bytes], bool]:
    """A check that a reconstructed self-mask seed is the one ``owner`` committed to."""
    return lambda seed: commit_self_mask(setup, owner, seed) == commitment


def matches_public_key(public_key: bytes) -> Callable[[bytes], bool]:
    """A check that a reconstructed X25519 private key belongs to ``public_key``."""
    return lambda secret: public_bytes(private_key_from_bytes(secret)) == public_key


def unmask_sum(
    setup: RoundSetup,
    graph: Mapping[str, frozenset[str]],
    total: np.ndarray,
    survivors: frozenset[str],
    dropped: frozenset[str],
    advertised: Mapping[str, AdvertisedKeys],
    self_mask_shares: Mapping[str, Mapping[int, bytes]],
    mask_key_shares: Mapping[str, Mapping[int, bytes]],
) -> np.ndarray:
    """Remove every mask from ``total`` (modified in place and returned)."""
    expander = MaskExpander(setup.masked_length)
    t = setup.threshold
    for v in sorted(survivors):
        commitment = advertised[v].self_mask_commitment
        seed = reconstruct_checked(self_mask_shares.get(v, {}), t,
                                   matches_commitment(setup, v, commitment),
                                   f"self-mask seed of {v!r}")
        expander.subtract_from(total, seed)
    for u in sorted(dropped):
        partners = sorted(graph[u] & survivors)
        if not partners:
            continue
        secret = reconstruct_checked(mask_key_shares.get(u, {}), t,
                                     matches_public_key(advertised[u].mask_public_key),
                                     f"mask key of dropped client {u!r}")
        key = private_key_from_bytes(secret)
        for v in partners:
            seed = derive_mask_seed(agree(key, advertised[v].mask_public_key), setup, u, v)
            if v < u:  # v added +PRG(s_vu): take it back
                expander.subtract_from(total, seed)
            else:  # v added -PRG(s_vu)
                expander.add_to(total, seed)
    return total
