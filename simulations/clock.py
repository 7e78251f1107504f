"""The virtual clock of synchronous rounds, with the server's over-selection.

A synchronous round lasts until it closes: until its slowest sampled client returns,
or, with over-selection, until the ``m``-th of ``ceil(m * over_selection)`` issued
clients returns (``m``: the clients the strategy sampled), the others being cancelled
as `fedloom.server` cancels them. `SyncClock.round` works this out from the clients'
speeds (`fedloom.simulations.speed`) before anyone trains, so an engine trains only the
clients whose updates count; the local engine and the Flower bridge both ask it, and
so time their rounds alike.

The extra clients are drawn as the server draws them (`fedloom.server.stragglers`):
the clients outside the plan ordered by (name, id), ``ceil(m * factor) - m`` of them
chosen by a generator seeded with ``(seed, round)``. The clients kept are the ``m``
earliest to finish, ties going to the earlier issued (planned before extra); they train
in the order they were issued. A client that fails does so after its fit and the round
does not wait for a replacement (the server would take the next arrival): a simulation
where clients fail and over-selection is on keeps fewer updates than the server.

>>> from fedloom.simulations.plan import client_infos
>>> from fedloom.simulations.speed import SpeedModel
>>> clock = SyncClock(SpeedModel([3.0, 1.0, 5.0, 2.0]), over_selection=1.5)
>>> timing = clock.round(1, ("0", "1"), client_infos(4))
>>> timing.num_sampled, timing.client_ids, timing.duration_s, clock.now
(3, ('1', '3'), 2.0, 2.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from fedloom.simulations.speed import SpeedModel
from fedloom.types import ClientInfo


@dataclasses.dataclass(frozen=True)
class RoundTiming:
    """One synchronous round on the virtual clock."""

    client_ids: tuple[str, ...]  # whose updates count: they train, in issue order
    num_sampled: int  # fit tasks issued (over-selection included)
    num_cancelled: int  # issued tasks cancelled when the round closed
    duration_s: float  # from the round's start until it closes
    ends_at_s: float  # the virtual time at which it closes


class SyncClock:
    """Times synchronous rounds one after the other (see the module docstring).

    Args:
        speed: the clients' fit durations.
        over_selection: issue this many times the sampled clients' fit tasks, keep the
            first to finish (the server's ``over_selection``; 1: off).
        seed: seeds the draw of the extra clients (the run's seed, as the server's).
    """

    def __init__(self, speed: SpeedModel, *, over_selection: float = 1.0, seed: int = 0) -> None:
        if not math.isfinite(over_selection) or over_selection < 1.0:
            raise ValueError(f"over_selection must be >= 1, got {over_selection}")
        self.speed = speed
        self.over_selection = over_selection
        self.seed = seed
        self.now = 0.0  # the virtual time at which the last round closed
        self.last: RoundTiming | None = None

    def round(self, server_round: int, planned: Sequence[str], clients: Sequence[ClientInfo],
              index_of: Callable[[str], int] = int) -> RoundTiming:
        """Open round ``server_round`` on the ``planned`` clients and close it.

        Args:
            server_round: the round, from 1 (it keys the fit times and the extra draw).
            planned: the client ids the strategy sampled, in plan order.
            clients: every client available, to over-select from.
            index_of: a client id's index in the speed model (its partition id).
        """
        issued = _over_select(tuple(planned), clients, self.over_selection, seed=self.seed,
                              server_round=server_round)
        finish = [self.speed.duration(index_of(cid), server_round) for cid in issued]
        by_arrival = sorted(range(len(issued)), key=lambda i: (finish[i], i))
        kept = sorted(by_arrival[:len(planned)])
        duration = finish[by_arrival[len(planned) - 1]] if planned else 0.0
        self.now += duration
        self.last = RoundTiming(tuple(issued[i] for i in kept), len(issued),
                                len(issued) - len(kept), duration, self.now)
        return self.last


def _over_select(planned: tuple[str, ...], clients: Sequence[ClientInfo], factor: float, *,
                 seed: int, server_round: int) -> tuple[str, ...]:
    """``planned`` plus the extra clients the server would issue tasks to.

    The rule of `fedloom.server.stragglers.over_select`, restated here because the
    simulations do not import the server's internals (nor, through them, grpc).
    """
    wanted = min(len(clients), math.ceil(len(planned) * factor - 1e-9))
    extra = wanted - len(planned)
    if extra <= 0:
        return planned
    taken = set(planned)
    pool = sorted((c for c in clients if c.client_id not in taken),
                  key=lambda c: (c.name, c.client_id))
    extra = min(extra, len(pool))
    rng = np.random.default_rng([seed % (1 << 63), server_round])
    picked = sorted(int(i) for i in rng.choice(len(pool), size=extra, replace=False))
    return planned + tuple(pool[i].client_id for i in picked)
