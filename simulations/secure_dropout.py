"""`SecureDropout`: clients that vanish mid-protocol in simulated secure rounds.

The ``[secure_dropout]`` table of a scenario (`fedloom.simulations.scenario`), used by
`fedloom.simulations.local_secure.LocalSecureAggregation`. A module of its own so that
loading a scenario does not import the server.

.. code-block:: toml

    [secure_dropout]
    fraction = 0.2          # of each round's participants
    after = "share_keys"    # the last stage they answer
    choice = "spread"       # or "random"
    rounds = []             # every round
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from fedloom.errors import ConfigError
from fedloom.secagg import Stage

#: The stages after which a client may vanish.
DROP_STAGES = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT)
DROP_CHOICES = ("spread", "random")


@dataclasses.dataclass(frozen=True)
class SecureDropout:
    """Clients that vanish mid-protocol in simulated secure rounds (``[secure_dropout]``).

    Attributes:
        fraction: share of each round's participants (those that trained) that vanish,
            rounded to the nearest client.
        after: the last stage they answer; they vanish once it has closed, so they
            never answer the next: ``advertise_keys`` (they are left out),
            ``share_keys`` (they are *dropped*: their neighbours masked against them,
            so the server reconstructs their mask keys) or ``masked_input`` (their input
            is in the sum; their self-mask seed is reconstructed without them; in an
            authenticated round they never confirm the survivor set, so the attempt
            fails and is retried without them, as over gRPC).
        choice: ``spread`` picks them on the round's neighbour graph so that every
            client keeps ``threshold`` neighbours that stay (the round finishes: what
            recovery costs); ``random`` picks them uniformly, seeded, and the round may
            fail as a real one would (`fedloom.secagg.dropout_failure_bound`).
        rounds: the rounds with dropouts; empty means every round.
        seed: seeds ``random``.
    """

    fraction: float = 0.0
    after: str = "share_keys"
    choice: str = "spread"
    rounds: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not 0.0 <= self.fraction < 1.0:
            raise ConfigError("secure_dropout.fraction",
                              f"must be in [0, 1), got {self.fraction!r}")
        if self.after not in {str(s) for s in DROP_STAGES}:
            raise ConfigError("secure_dropout.after",
                              f"{self.after!r} is not one of {', '.join(map(str, DROP_STAGES))}")
        if self.choice not in DROP_CHOICES:
            raise ConfigError("secure_dropout.choice",
                              f"{self.choice!r} is not one of {', '.join(DROP_CHOICES)}")
        object.__setattr__(self, "rounds", tuple(self.rounds))
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in self.rounds):
            raise ConfigError("secure_dropout.rounds", "must be a list of round numbers >= 1")

    @property
    def stage(self) -> Stage:
        return Stage(self.after)

    def applies_to(self, server_round: int) -> bool:
        return self.fraction > 0 and (not self.rounds or server_round in self.rounds)


def spread_dropouts(graph: Mapping[str, frozenset[str]], threshold: int,
                    candidates: Iterable[str], count: int) -> frozenset[str]:
    """Up to ``count`` of ``candidates`` to vanish such that every candidate keeps at
    least ``threshold`` neighbours among those that stay (so the round can finish).

    Greedy over the candidates in sorted order, every ``len / count``-th first;
    deterministic for a given graph, so any party that knows the attempt's graph (a
    benchmark's client processes, which derive it at share keys) computes the same set.
    """
    pool = set(candidates) & set(graph)
    ring = sorted(pool)
    if count <= 0 or not ring:
        return frozenset()
    stride = max(1, len(ring) // count)
    order = ring[::stride] + [c for i, c in enumerate(ring) if i % stride]
    staying = {u: len(graph[u] & pool) for u in ring}  # neighbours that stay, per client
    chosen: set[str] = set()
    for u in order:
        if len(chosen) == count:
            break
        if staying[u] < threshold or any(staying[v] <= threshold for v in graph[u] & pool):
            continue
        chosen.add(u)
        for v in graph[u] & pool:
            staying[v] -= 1
    return frozenset(chosen)
