"""Stragglers: over-selection.

Over-selection (Bonawitz et al., "Towards Federated Learning at Scale: System Design",
MLSys 2019, section 2: the server "selects a subset of the connected devices ...
typically 130% of the target count"). The strategy decides how many updates a round
needs (its `FitPlan`); the server issues ``ceil(needed * over_selection)`` fit tasks
(capped at the connected clients) and closes the round as soon as the needed number of
updates has arrived. The tasks still open then are *cancelled*: their clients hear
"round closed" if they push later, and their (already downloaded) work is discarded.

Limits, said plainly: taking the first updates favours fast clients (devices with
better hardware or networks weigh more in the model than their share of the data
suggests), and the extra clients spend computation that is thrown away. With
``fraction_fit = 1.0`` every connected client is already sampled, so there is no one
to over-select: the factor then changes nothing.

The extra clients are drawn with a generator seeded by ``(seed, round)``, so the draw
needs no state of its own in the checkpoint and a resumed run draws alike.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from fedloom.types import ClientInfo


@dataclasses.dataclass(frozen=True, slots=True)
class Selection:
    """Who receives a fit task this round, and how many updates close it early."""

    client_ids: tuple[str, ...]
    target: int


def over_select(
    planned: tuple[str, ...],
    connected: Sequence[ClientInfo],
    factor: float,
    *,
    seed: int,
    server_round: int,
) -> Selection:
    """Add ``ceil(len(planned) * factor) - len(planned)`` clients outside the plan.

    Args:
        planned: the strategy's sampled client ids (the round's target count).
        connected: every connected client.
        factor: the over-selection factor, at least 1 (1 adds no one).
        seed: the server's seed; with ``server_round`` it seeds the draw.
        server_round: the round being opened.

    Example::

        >>> clients = [ClientInfo(f"id{i}", f"c{i}", frozenset({"fit"})) for i in range(10)]
        >>> s = over_select(("id0", "id1"), clients, 1.5, seed=0, server_round=1)
        >>> len(s.client_ids), s.target
        (3, 2)
    """
    target = len(planned)
    wanted = min(len(connected), math.ceil(target * factor - 1e-9))
    extra = wanted - target
    if extra <= 0:
        return Selection(planned, target)
    taken = set(planned)
    pool = sorted(
        (c for c in connected if c.client_id not in taken), key=lambda c: (c.name, c.client_id)
    )
    extra = min(extra, len(pool))
    rng = np.random.default_rng([seed % (1 << 63), server_round])
    picked = sorted(int(i) for i in rng.choice(len(pool), size=extra, replace=False))
    return Selection(planned + tuple(pool[i].client_id for i in picked), target)
