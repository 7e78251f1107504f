"""Seeded client selection, checkpointable so a resumed run samples the same clients;
or, for differential privacy, secret selection (`ClientSampler.secret`)."""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedloom.errors import ConfigError
from fedloom.types import ClientInfo

#: Mixed into the evaluation generator's seed: its draws are not the fit draws'.
_EVALUATION = 0x4556414C


class ClientSampler:
    """Samples ``max(floor(n * fraction), min_clients)`` of ``n`` clients, capped at n.

    Clients are ordered by (name, id) before sampling, so the outcome depends on the
    seed and the set of clients, not on the order in which they joined. (Flower samples
    with an unseeded ``random.sample``.)
    """

    def __init__(self, seed: int) -> None:
        self._seed = seed
        self._rng = np.random.default_rng(seed)
        self._secret = False
        # The last tuple of clients and its ordering: a run that offers the same tuple
        # every round (the simulation engines do) sorts it once. A tuple of frozen
        # `ClientInfo`s cannot change, and holding it keeps its identity unique.
        self._ordered: tuple[tuple[ClientInfo, ...], list[ClientInfo]] | None = None

    def _order(self, clients: Sequence[ClientInfo]) -> list[ClientInfo]:
        cached = self._ordered
        if cached is not None and cached[0] is clients:
            return cached[1]
        ordered = sorted(clients, key=lambda c: (c.name, c.client_id))
        if isinstance(clients, tuple):
            self._ordered = (clients, ordered)
        return ordered

    def sample(
        self, clients: Sequence[ClientInfo], fraction: float, min_clients: int
    ) -> tuple[str, ...]:
        """A round's fit sample: draws from the sampler's generator (its state)."""
        return self._sample(self._rng, clients, fraction, min_clients)

    def sample_evaluation(
        self, clients: Sequence[ClientInfo], fraction: float, min_clients: int,
        server_round: int
    ) -> tuple[str, ...]:
        """A round's evaluation sample, from a generator of (seed, round) alone.

        Evaluation leaves the sampler's state as it was: the server commits a round
        before it evaluates the round's model, and a run resumed from that commit must
        draw the next fit samples an uninterrupted run draws, evaluation or not. A
        secret sampler draws from its own generator (nothing about it is replayed).
        """
        rng = self._rng if self._secret else np.random.default_rng(
            [self._seed, server_round, _EVALUATION])
        return self._sample(rng, clients, fraction, min_clients)

    def _sample(
        self, rng: np.random.Generator, clients: Sequence[ClientInfo], fraction: float,
        min_clients: int
    ) -> tuple[str, ...]:
        if not 0.0 <= fraction <= 1.0:
            raise ConfigError("fraction", f"must be in [0, 1], got {fraction}")
        ordered = self._order(clients)
        n = len(ordered)
        k = min(n, max(math.floor(n * fraction + 1e-9), min_clients))
        if k == 0:
            return ()
        if k == n:
            return tuple(c.client_id for c in ordered)
        picked = rng.choice(n, size=k, replace=False)
        return tuple(ordered[int(i)].client_id for i in sorted(picked))

    def sample_poisson(self, clients: Sequence[ClientInfo], rate: float) -> tuple[str, ...]:
        """Each client independently with probability ``rate`` (Poisson sampling).

        The number chosen varies from round to round (it may be 0); differential
        privacy's amplification by Poisson sampling assumes exactly this.
        """
        if not 0.0 <= rate <= 1.0:
            raise ConfigError("fraction", f"must be in [0, 1], got {rate}")
        ordered = self._order(clients)
        picked = self._rng.random(len(ordered)) < rate
        return tuple(c.client_id for c, keep in zip(ordered, picked, strict=True) if keep)

    @classmethod
    def secret(cls) -> ClientSampler:
        """A sampler whose choices nobody can predict: seeded from the OS CSPRNG, and
        never checkpointed (a resumed run draws from a fresh seed).

        Differential privacy's amplification by sampling assumes the adversary does not
        know who was sampled; with a seeded sampler, whoever has the run's config (seed
        0 by default) or a checkpoint would, and each round would cost its full,
        unamplified ε for the clients in it.
        """
        sampler = cls(0)
        sampler._make_secret()
        return sampler

    def _make_secret(self) -> None:
        self._rng, self._secret = np.random.default_rng(secrets.randbits(128)), True

    @property
    def is_secret(self) -> bool:
        return self._secret

    def state_dict(self) -> dict[str, Any]:
        if self._secret:
            return {"secret": True}
        return {"seed": self._seed, "bit_generator": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("secret") or self._secret:  # nothing to restore: draw afresh
            self._make_secret()
            return
        self._seed = int(state["seed"])
        self._rng = np.random.default_rng(self._seed)
        self._rng.bit_generator.state = state["bit_generator"]
