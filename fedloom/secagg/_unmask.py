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

Every share used here was checked, when it was revealed, against the commitment its
owner published with it (`fedloom.secagg.commit_share`), so a corrupted share never
gets this far. If t checked shares still do not reconstruct the secret the owner
committed to, the owner dealt inconsistent shares: `DealerFaultError` names it.

Each seed is expanded once, block by block into the sum, over ranges that may run in
parallel.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from fedloom.errors import SecureAggregationError
from fedloom.secagg._crypto import (
    agree,
    commit_self_mask,
    derive_mask_seed,
    private_key_from_bytes,
    public_bytes,
)
from fedloom.secagg._messages import AdvertisedKeys
from fedloom.secagg._prg import MaskExpander
from fedloom.secagg._setup import RoundSetup
from fedloom.secagg._shamir import reconstruct

#: How many threshold-sized subsets to try when a reconstruction fails its check
#: (the owner dealt inconsistent shares); each try costs t field inversions.
MAX_SUBSETS = 64


class DealerFaultError(SecureAggregationError):
    """Checked shares of ``owner``'s secret do not reconstruct what ``owner`` committed
    to: ``owner`` dealt inconsistent shares (its fault, not its neighbours')."""

    def __init__(self, owner: str, message: str) -> None:
        super().__init__(message)
        self.owner = owner


def reconstruct_checked(shares: Mapping[int, bytes], threshold: int,
                        check: Callable[[bytes], bool], what: str, owner: str = "") -> bytes:
    """Reconstruct a secret from ``{x: share}`` and accept it only if ``check`` passes.

    With more than ``threshold`` shares, other subsets are tried when the first fails.

    Raises:
        SecureAggregationError: fewer than ``threshold`` shares.
        DealerFaultError: no subset reconstructs a secret that passes ``check``.
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
    raise DealerFaultError(owner, f"{what}: the revealed shares match their commitments but do "
                           f"not reconstruct the secret {owner!r} committed to ({owner!r} dealt "
                           "inconsistent shares)")


def matches_commitment(setup: RoundSetup, owner: str,
                       commitment: bytes) -> Callable[[bytes], bool]:
    """A check that a reconstructed self-mask seed is the one ``owner`` committed to."""
    return lambda seed: commit_self_mask(setup, owner, seed) == commitment


def matches_public_key(public_key: bytes) -> Callable[[bytes], bool]:
    """A check that a reconstructed X25519 private key belongs to ``public_key``."""
    return lambda secret: public_bytes(private_key_from_bytes(secret)) == public_key


#: Words per range when the unmasking is split among workers (a multiple of 16).
RANGE_WORDS = 1 << 18

#: ``map``-like: applies a function to every item (e.g. a thread pool's ``map``).
MapFn = Callable[[Callable[[tuple[int, int]], None], Iterable[tuple[int, int]]], Iterable[None]]


def unmask_sum(
    setup: RoundSetup,
    graph: Mapping[str, frozenset[str]],
    total: np.ndarray,
    survivors: frozenset[str],
    dropped: frozenset[str],
    advertised: Mapping[str, AdvertisedKeys],
    commitments: Mapping[str, bytes],
    self_mask_shares: Mapping[str, Mapping[int, bytes]],
    mask_key_shares: Mapping[str, Mapping[int, bytes]],
    map_fn: MapFn = map,
) -> np.ndarray:
    """Remove every mask from ``total`` (modified in place and returned).

    The secrets are reconstructed first; then every mask is removed in one blocked pass
    (`MaskExpander.apply`) over ranges of the vector, which ``map_fn`` may run in
    parallel threads (each range has its own expander; OpenSSL and numpy release the
    GIL).
    """
    t = setup.threshold
    masks: list[tuple[bytes, int]] = []
    for v in sorted(survivors):
        seed = reconstruct_checked(self_mask_shares.get(v, {}), t,
                                   matches_commitment(setup, v, commitments[v]),
                                   f"self-mask seed of {v!r}", v)
        masks.append((seed, -1))
    for u in sorted(dropped):
        partners = sorted(graph[u] & survivors)
        if not partners:
            continue
        secret = reconstruct_checked(mask_key_shares.get(u, {}), t,
                                     matches_public_key(advertised[u].mask_public_key),
                                     f"mask key of dropped client {u!r}", u)
        key = private_key_from_bytes(secret)
        for v in partners:
            seed = derive_mask_seed(agree(key, advertised[v].mask_public_key), setup, u, v)
            # v added +PRG(s_vu) if v < u (take it back), else -PRG(s_vu) (add it back)
            masks.append((seed, -1 if v < u else 1))
    length = setup.masked_length
    ranges = [(a, min(length, a + RANGE_WORDS)) for a in range(0, length, RANGE_WORDS)]

    def remove(span: tuple[int, int]) -> None:
        MaskExpander(length).apply(total, masks, *span)

    for _ in map_fn(remove, ranges):
        pass
    return total
