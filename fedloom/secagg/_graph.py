"""The k-regular neighbour graph of SecAgg+ (Bell et al., CCS 2020, section 4).

Bell et al. pair each client with k others instead of all n - 1, so a client's work
grows with log n instead of n. As they suggest, the graph is a Harary graph over a
random permutation of the clients: the participants are ordered by
``SHA-256(graph_seed || id)`` (the seed is public and fixed by the round's setup, so
every client and the server compute the same graph), placed on a ring, and each is
joined to the k/2 nearest on either side. k is even (`SecAggConfig` requires it), so the
graph is k-regular whenever n > k + 1; with n <= k + 1 every client neighbours all others.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from fedloom.secagg._encoding import pack
from fedloom.secagg._messages import RoundSetup


def ring_order(participants: tuple[str, ...], seed: bytes) -> list[str]:
    """The participants in the seeded pseudo-random order that places them on the ring."""
    return sorted(participants, key=lambda pid: hashlib.sha256(seed + pack(pid)).digest())


def neighbour_graph(setup: RoundSetup) -> Mapping[str, frozenset[str]]:
    """Each participant's neighbours (never itself); symmetric."""
    ring = ring_order(setup.participants, setup.graph_seed)
    n, half = len(ring), setup.neighbours // 2
    if n - 1 <= setup.neighbours:
        everyone = frozenset(ring)
        return {pid: everyone - {pid} for pid in ring}
    return {
        pid: frozenset(ring[(i + d) % n] for d in range(-half, half + 1) if d)
        for i, pid in enumerate(ring)
    }
