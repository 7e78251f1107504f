"""Central differential privacy around a mean-based strategy (DP-FedAvg and its family).

`CentralDPStrategy` is McMahan et al.'s DP-FedAvg (ICLR 2018) as a wrapper: each round
it

1. samples clients (the inner strategy's sampler: m of n, or Poisson with probability
   ``fraction_fit``) and asks them to clip their delta to C (the fit config's
   ``max_update_norm``; `TorchClient` does and reports the norm before clipping);
2. clips every update again to C on arrival (a client that ignores the bound is
   clipped, not trusted), and sums the clipped deltas as a stream;
3. adds Gaussian noise of std ``z_delta * C`` to the sum, from a generator seeded by
   the operating system's CSPRNG (never checkpointed: whoever reads a checkpoint must
   not be able to predict the noise of later rounds), and divides by the expected
   number of clients (m, or q n), which does not depend on the data;
4. hands that noised mean, as the round's one update, to the inner strategy, whose
   server optimizer (SGD, momentum, Adagrad, Adam, Yogi) post-processes it;
5. records the round in the `PrivacyAccountant` and reports ε in the round's metrics.

With ``clipping = "adaptive"`` (Andrew et al., NeurIPS 2021) C follows the
``target_quantile`` of the update norms: each client adds ``b - 1/2`` (b = 1 when its
norm was within C) to a second sum, noised with std ``count_noise_std``, and
``C <- C * exp(-rate * (b_mean - quantile))``. The two releases together cost what
one of multiplier z does, for ``z_delta = (z**-2 - (2 sigma_b)**-2) ** -0.5``.

Before a round starts, `configure_fit` projects ε with that round included and raises
`PrivacyBudgetExhausted` when it would pass ``target_epsilon``: the round is never run,
so no model past the budget is released.

Not private: integer tensors (e.g. ``num_batches_tracked``) are not updated (their
deltas count examples), and the clients' own fit metrics are not aggregated (they are
functions of the data); federated evaluation metrics are released as they are. The
operator's logs (who took part) are outside the guarantee, which covers the models.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from fedloom.errors import AggregationError, ConfigError, PrivacyBudgetExhausted
from fedloom.fit_config import UPDATE_NORM
from fedloom.privacy import PrivacyAccountant, PrivacyConfig, RoundEvent
from fedloom.privacy._accountant import none_multiplier
from fedloom.strategies._base import StateDict
from fedloom.strategies._composed import ComposedStrategy
from fedloom.strategies._mean import WeightedMeanAggregator
from fedloom.strategies._metrics import DP_MEAN_ID, warn_unused_fit_hook
from fedloom.strategies._norm_bound import MODE_KEY
from fedloom.strategies._sampling import ClientSampler
from fedloom.strategies._secure_mean import MEAN_STRATEGIES
from fedloom.types import (
    MAX_NORM_KEY,
    AggregateResult,
    ClientInfo,
    ClientUpdate,
    EvaluatePlan,
    EvaluateResult,
    FitPlan,
    Metrics,
    Scalar,
)
from fedloom.weights import Weights

logger = logging.getLogger(__name__)

#: The fit metric with the client's norm before it clipped (`TorchClient` reports it).
REPORTED_NORM_KEY = UPDATE_NORM


def check_dp_strategy(inner: Any) -> ComposedStrategy:
    """Refuse an inner strategy that is not a plain mean (robust rules, wrappers)."""
    aggregator = getattr(inner, "aggregator", None)
    if not isinstance(inner, ComposedStrategy) or not isinstance(
            aggregator, WeightedMeanAggregator):
        raise ConfigError(
            "strategy.name",
            f"{type(inner).__name__} cannot run with [privacy]: differential privacy adds "
            "noise to the sum of clipped updates, which needs a mean-based strategy "
            f"({MEAN_STRATEGIES}); robust rules choose among individual updates, and no "
            "noise calibrated to one client's influence covers that",
        )
    warn_unused_fit_hook(inner, "[privacy]: client fit metrics are functions of their data, "
                                "outside the privacy guarantee")
    return inner


def split_noise(z: float, count_noise_std: float) -> float:
    """The delta sum's multiplier that, with the count's noise, costs one release of ``z``."""
    if 2.0 * count_noise_std <= z:
        raise ConfigError(
            "privacy.count_noise_std",
            f"adaptive clipping needs 2 * count_noise_std ({2 * count_noise_std:g}) above "
            f"the noise multiplier ({z:g}): raise count_noise_std or the clients per round",
        )
    return (z**-2 - (2.0 * count_noise_std) ** -2) ** -0.5


class _Planned(NamedTuple):
    """A configured round: the event it would record and how its noise is made."""

    event: RoundEvent
    expected: float  # the data-independent denominator: m, or q n
    z_delta: float  # the delta sum's noise multiplier
    count_std: float  # the clipped count's noise std (adaptive clipping; 0 otherwise)


class PrivateMeanWrapper:
    """What both private wrappers share: the inner strategy's evaluation, its optimizer
    step on the round's one (noised) mean, and the round's metrics."""

    inner: ComposedStrategy
    privacy: PrivacyConfig
    _warned: set[str]  # what `_warn_population` has said this run

    def _warn_population(self, population: int, rate: float = 0.0) -> None:
        """Warn, once per run and kind, where the round's population makes the stated
        guarantee weaker than it reads: δ at or above 1/n (a mechanism may then expose a
        whole client's data with probability δ), or, under Poisson sampling, an empty
        draw (held back without charge) likelier than δ: the unaccounted term
        ``q (1 - q)^(n - 1)``."""
        warned, delta = self._warned, self.privacy.delta
        if population > 0 and delta >= 1.0 / population and "delta" not in warned:
            warned.add("delta")
            logger.warning("[privacy] delta = %g is at least 1/n for the %d clients of this "
                           "run: the guarantee allows a client's data to be exposed with "
                           "that probability; set privacy.delta well below %g", delta,
                           population, 1.0 / population)
        if 0.0 < rate < 1.0 and population > 0 and "empty" not in warned:
            leak = rate * (1.0 - rate) ** (population - 1)
            if leak > delta:
                warned.add("empty")
                logger.warning("[privacy] with %d clients at fraction_fit = %g, a round "
                               "whose Poisson draw is empty is held back without charge, "
                               "which leaks up to %.2g a round beyond the accounted "
                               "epsilon (more than delta = %g): sample more clients a round "
                               "(q*n well above 1) or use sampling = \"fixed\"", population,
                               rate, leak, delta)

    def _step(self, server_round: int, current: Weights, mean: Weights) -> AggregateResult:
        """The inner strategy's step with ``mean`` as the round's one update."""
        update = ClientUpdate(DP_MEAN_ID, mean, 1, server_round - 1)
        return self.inner.aggregate_fit(server_round, current, [update])

    def _metrics(self, result: AggregateResult, count: int, epsilon: float,
                 **extra: Scalar) -> dict[str, Scalar]:
        """The inner strategy's metrics (less its one-update counts) and the privacy spent."""
        metrics: dict[str, Scalar] = {
            k: v for k, v in result.metrics.items() if k not in ("num_updates", "num_examples")}
        metrics.update(num_updates=count, privacy_epsilon=epsilon,
                       privacy_delta=self.privacy.delta,
                       noise_multiplier=self.privacy.noise_multiplier, **extra)
        return metrics

    def configure_evaluate(
        self, server_round: int, current: Weights, clients: Sequence[ClientInfo]
    ) -> EvaluatePlan:
        return self.inner.configure_evaluate(server_round, current, clients)

    def aggregate_evaluate(self, server_round: int, results: Iterable[EvaluateResult]) -> Metrics:
        return self.inner.aggregate_evaluate(server_round, results)


class CentralDPStrategy(PrivateMeanWrapper):
    """Client-level DP with the noise added by the server; see the module docstring.

    Args:
        inner: a mean-based `ComposedStrategy` (FedAvg, FedAvgM, FedProx, FedAdagrad,
            FedAdam, FedYogi) whose sampler and server optimizer are used.
        privacy: the ``[privacy]`` settings, ``mode = "central"``.
        rng: the noise generator; leave it out except in tests and reproducible
            studies. Left out, the noise comes from a CSPRNG-seeded generator and the
            inner strategy samples clients secretly (`ClientSampler.secret`: the
            ``selection.seed`` is not used, and neither is checkpointed); given, both
            are as reproducible as the seeds, and the reported ε assumes what only a
            secret sample gives.
    """

    def __init__(self, inner: ComposedStrategy, privacy: PrivacyConfig, *,
                 rng: np.random.Generator | None = None) -> None:
        if privacy.mode != "central":
            raise ConfigError("privacy.mode", f'CentralDPStrategy needs "central", got '
                              f"{privacy.mode!r}")
        self.inner = check_dp_strategy(inner)
        self.privacy = privacy
        self.clip_norm = privacy.clip_norm
        self.accountant = PrivacyAccountant(privacy.accountant, privacy.sampling, privacy.delta)
        self._warned = set()
        self._rng = rng if rng is not None else np.random.default_rng(secrets.randbits(128))
        if rng is None:  # amplification by sampling needs a sample nobody can predict
            self.inner.sampler = ClientSampler.secret()
        # round -> (the event it would record, the data-independent denominator), or
        # why the round is not run (a Poisson draw that came out empty; too few clients
        # for adaptive clipping's noise split)
        self._planned: dict[int, _Planned | str] = {}
        self._warn_small_rounds()

    def __repr__(self) -> str:
        return (f"CentralDPStrategy({self.inner!r}, z={self.privacy.noise_multiplier}, "
                f"clipping={self.privacy.clipping!r}, sampling={self.privacy.sampling!r})")

    # -- fit -------------------------------------------------------------------------
    def configure_fit(
        self, server_round: int, current: Weights, clients: Sequence[ClientInfo]
    ) -> FitPlan:
        p, inner = self.privacy, self.inner
        n = len(clients)
        self._warn_population(n, inner.selection.fraction_fit if p.sampling == "poisson"
                              else 0.0)
        if p.sampling == "poisson":
            rate = inner.selection.fraction_fit
            chosen = inner.sampler.sample_poisson(clients, rate)
            config = inner.fit_round_config(server_round)
            event, expected = RoundEvent(p.noise_multiplier, 0, n, rate), rate * n
        else:
            plan = inner.configure_fit(server_round, current, clients)
            chosen, config = plan.client_ids, plan.config
            m = len(chosen)
            z = p.noise_multiplier
            if p.sampling == "none":  # everyone at any n, or an added client may displace
                z = none_multiplier(z, inner.selection.fraction_fit < 1.0)
            event, expected = RoundEvent(z, m, n), float(m)
        if not chosen:
            self._planned = {server_round: "no client was sampled (the Poisson draw was empty)"}
            return FitPlan((), config)
        try:  # an impossible noise split is found here, before clients train
            planned = _Planned(event, expected, *self._noise_split(expected))
        except ConfigError as exc:
            # Too few clients this round for adaptive clipping's two releases to cost one
            # of z: the round is not run (nothing is released or spent), and the next,
            # with more clients, may be. A crash here would stop a run whose settings a
            # resume may not change.
            self._planned = {server_round: f"not run: {exc.problem}"}
            return FitPlan((), config)
        if p.target_epsilon:
            spent, projected = self.accountant.epsilon(), self.accountant.epsilon_if(event)
            if projected > p.target_epsilon:
                raise PrivacyBudgetExhausted(spent, projected, p.target_epsilon, p.delta)
        self._planned = {server_round: planned}
        config = {**config, MAX_NORM_KEY: self.clip_norm, MODE_KEY: "clip"}
        return FitPlan(chosen, config)

    def aggregate_fit(
        self, server_round: int, current: Weights, updates: Iterable[ClientUpdate]
    ) -> AggregateResult:
        if server_round not in self._planned:
            raise AggregationError(f"round {server_round} was not configured by this strategy")
        planned = self._planned[server_round]
        if isinstance(planned, str):
            return AggregateResult(None, num_updates=0, reason=planned)
        event, expected, z_delta, count_std = planned
        clip = self.clip_norm
        sums = {name: np.zeros(arr.shape, np.float64) for name, arr in current.items()
                if arr.dtype.kind == "f"}
        count = unclipped = 0
        for update in updates:  # the stream; nothing of this object changes in the loop
            arrays = {name: np.asarray(update.delta[name], np.float64) for name in sums}
            norm = math.sqrt(sum(float(np.dot(a.ravel(), a.ravel())) for a in arrays.values()))
            reported = update.metrics.get(REPORTED_NORM_KEY)
            before = (float(reported) if isinstance(reported, int | float)
                      and not isinstance(reported, bool) and math.isfinite(reported) else norm)
            unclipped += before <= clip
            count += 1
            if not math.isfinite(norm):
                # min(1, C / nan) is 1: unclipped, it would pass every other value whole.
                # It counts as a zero update (bounded, like any other), never as a hole.
                logger.warning("round %d: client %s sent a non-finite update; it counts "
                               "as zero", server_round, update.client_id)
                continue
            scale = min(1.0, clip / norm) if norm > 0 else 1.0
            for name, total in sums.items():
                total += arrays[name] * scale
        if count == 0:
            return AggregateResult(None, num_updates=0, reason="no client returned an update")
        for total in sums.values():
            total += self._rng.normal(0.0, z_delta * clip, total.shape)
            total /= expected
        mean = Weights((name, sums[name].astype(arr.dtype) if name in sums
                        else np.zeros_like(arr)) for name, arr in current.items())
        result = self._step(server_round, current, mean)
        if result.weights is None:
            return AggregateResult(None, num_updates=count, reason=result.reason)
        # The round is released: from here on its cost is spent and C moves.
        del self._planned[server_round]
        epsilon = self.accountant.record(event)
        if self.privacy.clipping == "adaptive":
            noisy = unclipped - count / 2.0 + self._rng.normal(0.0, count_std)
            share = noisy / expected + 0.5
            self.clip_norm = clip * math.exp(
                -self.privacy.clip_learning_rate * (share - self.privacy.target_quantile))
        metrics = self._metrics(result, count, epsilon, clip_norm=clip,
                                noise_std=z_delta * clip / expected)
        return AggregateResult(result.weights, metrics, num_updates=count)

    def _warn_small_rounds(self) -> None:
        """Adaptive clipping's noise split, checked at start: with a ``count_noise_std``
        set, it holds for every round or none (refused); with the default (expected
        clients / 20) it needs more than ``10 z`` clients a round, and a smaller round is
        not run: said here when ``min_fit_clients`` allows one (fixed sampling)."""
        p = self.privacy
        if p.clipping != "adaptive":
            return
        if p.count_noise_std:
            split_noise(p.noise_multiplier, p.count_noise_std)  # ConfigError: every round
            return
        need = math.floor(10.0 * p.noise_multiplier) + 1
        smallest = self.inner.selection.min_fit_clients
        if p.sampling != "poisson" and smallest < need:
            logger.warning("[privacy] adaptive clipping with the default count_noise_std "
                           "needs more than 10 * noise_multiplier clients a round: a round "
                           "of fewer than %d clients is not run (min_fit_clients is %d): "
                           "raise min_fit_clients, or set privacy.count_noise_std", need,
                           smallest)

    def _noise_split(self, expected: float) -> tuple[float, float]:
        """(z of the delta sum, std of the clipped count's noise) for this round."""
        z = self.privacy.noise_multiplier
        if self.privacy.clipping != "adaptive":
            return z, 0.0
        count_std = self.privacy.count_noise_for(expected)
        return split_noise(z, count_std), count_std

    # -- state -----------------------------------------------------------------------
    def privacy_spent(self) -> tuple[float, float]:
        """(ε, δ) of the rounds released so far."""
        return self.accountant.epsilon(), self.privacy.delta

    def state_dict(self) -> StateDict:
        return {"inner": self.inner.state_dict(),
                "privacy": {"accountant": self.accountant.state_dict(),
                            "clip_norm": self.clip_norm}}

    def load_state_dict(self, state: StateDict) -> None:
        privacy = state.get("privacy")
        if not isinstance(privacy, dict):
            raise ConfigError(
                "privacy", "the run was checkpointed without [privacy]: a run cannot become "
                "private half way (its earlier rounds were released without noise)")
        clip = float(np.asarray(privacy["clip_norm"]).reshape(-1)[0])
        if not (math.isfinite(clip) and clip > 0):
            raise ValueError(f"a checkpointed clip norm must be positive, got {clip!r}")
        self.accountant.load_state_dict(privacy["accountant"])
        self.inner.load_state_dict(state["inner"])
        self.clip_norm = clip
        self._planned = {}



def apply_privacy(strategy: Any, privacy: PrivacyConfig, *, colluding_clients: int = 1) -> Any:
    """``strategy`` wrapped for ``privacy``'s mode (unchanged when it is off).

    Raises:
        ConfigError: the strategy cannot run privately (a robust rule; a norm bound of
            its own, where ``privacy.clip_norm`` is the bound), or the mode needs what
            this build of the strategy lacks.
    """
    from fedloom.strategies._ddp import DistributedDPStrategy
    from fedloom.strategies._norm_bound import NormBoundedStrategy

    if not privacy.enabled or isinstance(strategy, CentralDPStrategy | DistributedDPStrategy):
        return strategy
    if isinstance(strategy, NormBoundedStrategy):
        raise ConfigError(
            "strategy.max_update_norm",
            "is replaced by privacy.clip_norm under [privacy] (the clipping bound is part "
            "of the guarantee); remove max_update_norm from [strategy]",
        )
    if privacy.mode == "central":
        return CentralDPStrategy(strategy, privacy)
    return DistributedDPStrategy(strategy, privacy, colluding_clients=colluding_clients)
