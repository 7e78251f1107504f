"""Distributed differential privacy: the clients add the noise, inside SecAgg+.

`DistributedDPStrategy` wraps a mean-based strategy for ``[privacy] mode =
"distributed"`` (with ``[secure_aggregation] enabled``). Each round it

1. samples m clients (the inner strategy's sampler) and calibrates the Skellam
   mechanism (`fedloom.privacy._skellam.calibrate`) so that ``m (1 - p)`` survivors' noise
   matches the central Gaussian of multiplier z on the sum, with the modular sum of m
   clients unwrapped in Z_{2^32}; p is ``expected_dropout``;
2. announces the parameters and a fresh rotation seed in the fit config, and the
   least number of survivors whose sum clients may unmask, ``ceil(m (1 - p))``
   (`MIN_SURVIVORS_KEY`: the secure round raises its survivor floor to it, so the
   server never sees a sum with less noise than the accountant assumed);
3. decodes the unmasked sum (`aggregate_secure_sum`), divides by the survivors and hands
   the mean, as the round's one update, to the inner strategy's server optimizer;
4. records the round's RDP at the noise really summed (`SkellamLedger`), as soon as the
   sum is unmasked: a sum the round then cannot use was still seen by the server.

The run stops before a round whose worst allowed case (the survivor floor) would take
ε past ``target_epsilon``. Client fit metrics are never seen (secure aggregation).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from fedloom.errors import AggregationError, ConfigError, PrivacyBudgetExhausted
from fedloom.privacy import PrivacyConfig
from fedloom.privacy._distributed import (
    MIN_SURVIVORS_KEY,
    SkellamLedger,
    decode_secagg_total,
    noisy_shares,
    to_fit_config,
)
from fedloom.privacy._skellam import SkellamParams, calibrate
from fedloom.secagg import SecAggResult
from fedloom.strategies._base import StateDict
from fedloom.strategies._composed import ComposedStrategy
from fedloom.strategies._dp import PrivateMeanWrapper, check_dp_strategy
from fedloom.strategies._secure_mean import delta_like
from fedloom.types import (
    AggregateResult,
    ClientInfo,
    ClientUpdate,
    FitPlan,
)
from fedloom.weights import Weights


class DistributedDPStrategy(PrivateMeanWrapper):
    """Client-level DP with Skellam noise added by the clients under SecAgg+.

    Args:
        inner: a mean-based `ComposedStrategy` (its sampler and server optimizer).
        privacy: the ``[privacy]`` settings, ``mode = "distributed"``.
        colluding_clients: clients assumed to collude with the server (their noise is
            not counted); the secure aggregation's ``colluding_clients``.
        rng: the source of each round's (public) rotation seed; leave it out (the OS
            CSPRNG) except for reproducible simulations.
    """

    def __init__(self, inner: ComposedStrategy, privacy: PrivacyConfig, *,
                 colluding_clients: int = 1, rng: np.random.Generator | None = None) -> None:
        if privacy.mode != "distributed":
            raise ConfigError("privacy.mode", f'DistributedDPStrategy needs "distributed", '
                              f"got {privacy.mode!r}")
        if colluding_clients < 0:
            raise ConfigError("secure_aggregation.colluding_clients", "must be >= 0")
        self.inner = check_dp_strategy(inner)
        self.privacy = privacy
        self.colluding_clients = colluding_clients
        self._rng = rng
        self.ledger = SkellamLedger(privacy.delta)
        self._warned = set()
        self._planned: dict[int, tuple[SkellamParams, bytes, int]] = {}

    def __repr__(self) -> str:
        return (f"DistributedDPStrategy({self.inner!r}, z={self.privacy.noise_multiplier}, "
                f"clip_norm={self.privacy.clip_norm})")

    def configure_fit(
        self, server_round: int, current: Weights, clients: Sequence[ClientInfo]
    ) -> FitPlan:
        p = self.privacy
        self._warn_population(len(clients))
        plan = self.inner.configure_fit(server_round, current, clients)
        m = len(plan.client_ids)
        self._planned = {}
        if m == 0:
            return plan
        size = sum(spec.size for spec in current.specs())
        params = calibrate(p.clip_norm, size, m, p.noise_multiplier,
                           dropout_rate=p.expected_dropout)
        floor = max(1, math.ceil(m * (1.0 - p.expected_dropout)))
        noisy = noisy_shares(floor, self.colluding_clients)
        if noisy < 1:
            raise ConfigError(
                "privacy.expected_dropout",
                f"a round of {m} clients may end with {floor} survivors, and with "
                f"{self.colluding_clients} colluding that leaves no honest client's noise: "
                "sample more clients per round or expect fewer dropouts")
        if p.target_epsilon:
            spent, projected = self.ledger.epsilon(), self.ledger.epsilon_if(params, noisy)
            if projected > p.target_epsilon:
                raise PrivacyBudgetExhausted(spent, projected, p.target_epsilon, p.delta)
        seed = self._rng.bytes(16) if self._rng is not None else secrets.token_bytes(16)
        self._planned = {server_round: (params, seed, floor)}
        config = {**plan.config, **to_fit_config(params, seed), MIN_SURVIVORS_KEY: floor}
        return FitPlan(plan.client_ids, config)

    def aggregate_secure_sum(self, server_round: int, current: Weights,
                             outcome: SecAggResult) -> AggregateResult:
        """The round's step from its unmasked sum (called by the secure round)."""
        planned = self._planned.get(server_round)
        if planned is None:
            raise AggregationError(f"round {server_round} was not configured by this strategy")
        params, seed, floor = planned
        survivors = len(outcome.survivors)
        # The server holds this noised sum from now on, whatever becomes of the round (a
        # bad count, too few survivors, a failed step): it is a release, accounted here.
        epsilon = self.ledger.record(params, noisy_shares(survivors, self.colluding_clients))
        total, count = decode_secagg_total(outcome.total, params, seed)
        if count != survivors:
            raise AggregationError(f"the unmasked sum counts {count} contributors, but "
                                   f"{survivors} survived: a client encoded another round")
        if survivors < floor:
            raise AggregationError(f"{survivors} survivors, below the round's floor {floor}")
        total /= survivors
        result = self._step(server_round, current, delta_like(total, current))
        if result.weights is None:
            return AggregateResult(None, {"privacy_epsilon": epsilon},
                                   num_updates=survivors, reason=result.reason)
        del self._planned[server_round]
        metrics = self._metrics(result, survivors, epsilon, clip_norm=params.clip_norm,
                                ddp_scale=params.scale)
        return AggregateResult(result.weights, metrics, num_updates=survivors)

    def aggregate_fit(
        self, server_round: int, current: Weights, updates: Iterable[ClientUpdate]
    ) -> AggregateResult:
        raise AggregationError(
            "distributed differential privacy aggregates inside secure aggregation only; "
            "enable [secure_aggregation] or use [privacy] mode = \"central\"")

    def privacy_spent(self) -> tuple[float, float]:
        return self.ledger.epsilon(), self.privacy.delta

    def state_dict(self) -> StateDict:
        return {"inner": self.inner.state_dict(),
                "privacy": {"ledger": self.ledger.state_dict()}}

    def load_state_dict(self, state: StateDict) -> None:
        privacy: Any = state.get("privacy")
        if not isinstance(privacy, dict) or "ledger" not in privacy:
            raise ConfigError(
                "privacy", "the run was checkpointed without distributed [privacy]: its earlier "
                "rounds were released under other terms")
        self.ledger.load_state_dict(privacy["ledger"])
        self.inner.load_state_dict(state["inner"])
        self._planned = {}
