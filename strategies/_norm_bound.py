"""An update-norm bound that combines with any strategy: clip or reject large deltas.

A delta whose global L2 norm (over every floating-point tensor, in float64) exceeds
``max_update_norm`` is either scaled down to that norm (``"clip"``, the bound of
Sun et al., "Can You Really Backdoor Federated Learning?", 2019, and the clipping step
of DP-FedAvg, McMahan et al., ICLR 2018) or dropped from the round (``"reject"``).
Integer tensors (buffers such as ``num_batches_tracked``) are neither counted in the
norm nor scaled. A clipped float32 tensor may exceed the bound by float32 rounding.

`NormBoundedStrategy` wraps any `Strategy`: it bounds each update as the stream passes,
so linear strategies still aggregate in constant memory, and adds ``num_clipped`` and
``num_rejected`` to the round's metrics. It sends the bound to clients in the fit
config (``"max_update_norm"``, ``"norm_bound_mode"``) so that clients can clip
themselves: under secure aggregation the server sees only the masked sum, so the
bound can only be applied on the client. The norm and the clipping are the kernel's
(`fedloom.weights.clip_to_norm`), which the client SDK uses too: `TorchClient` clips with them
and reports the norm before clipping as the fit metric ``update_norm``; other clients
can call `clip_update` on their delta before masking.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

from fedloom.errors import ConfigError
from fedloom.fit_config import MAX_UPDATE_NORM, NORM_BOUND_MODE
from fedloom.strategies._base import StateDict, Strategy
from fedloom.types import (
    AggregateResult,
    ClientInfo,
    ClientUpdate,
    EvaluatePlan,
    EvaluateResult,
    FitPlan,
    Metrics,
)
from fedloom.weights import Weights, check_norm_bound, clip_to_norm, l2_norm

NormBoundMode = Literal["clip", "reject"]
NORM_BOUND_MODES: tuple[str, ...] = ("clip", "reject")
#: The fit-config key of what the server does with a larger update (kept under this
#: name for the strategies that send it).
MODE_KEY = NORM_BOUND_MODE

#: Global L2 norm of a delta over its floating-point tensors, in float64 (the kernel's
#: `fedloom.weights.l2_norm`, under the strategies' public name).
update_norm = l2_norm


def clip_update(delta: Weights, max_update_norm: float) -> Weights:
    """Scale ``delta`` so its global L2 norm is at most ``max_update_norm``.

    Pure: returns ``delta`` itself when it is within the bound, else a new `Weights`
    whose floating-point tensors are multiplied by ``max_update_norm / norm`` (computed
    in float64, cast back); integer tensors are kept as they are
    (`fedloom.weights.clip_to_norm`).

    >>> import numpy as np
    >>> d = Weights({"w": np.array([3.0, 4.0], np.float32)})
    >>> clip_update(d, 1.0)["w"]
    array([0.6, 0.8], dtype=float32)
    """
    return clip_to_norm(delta, max_update_norm).weights


class NormBoundedStrategy:
    """Wraps a strategy so every update's delta norm is bounded before it aggregates.

    Args:
        inner: the strategy that aggregates the bounded updates.
        max_update_norm: the bound on each delta's global L2 norm, > 0 (in ``[strategy]``,
            unset means no bound). Sent to clients in the fit config too: `TorchClient`
            clips its own update to it (under secure aggregation, the only place the
            bound can hold).
        norm_bound_mode: ``"clip"`` (scale down to the bound, default) or ``"reject"``
            (drop the update from the round). Counted as ``num_clipped`` /
            ``num_rejected`` in round metrics.

    The wrapper keeps no state of its own: `state_dict` is the inner strategy's, and a
    round whose updates iterable raises leaves the inner strategy as it was (the inner
    strategy's rule).
    """

    def __init__(
        self, inner: Strategy, max_update_norm: float, norm_bound_mode: NormBoundMode = "clip"
    ) -> None:
        self.max_update_norm = check_norm_bound(max_update_norm)
        if norm_bound_mode not in NORM_BOUND_MODES:
            raise ConfigError(
                "norm_bound_mode",
                f"must be one of {', '.join(map(repr, NORM_BOUND_MODES))}, "
                f"got {norm_bound_mode!r}",
            )
        self.inner = inner
        self.norm_bound_mode: NormBoundMode = norm_bound_mode

    def __repr__(self) -> str:
        return (f"NormBoundedStrategy({self.inner!r}, max_update_norm={self.max_update_norm}, "
                f"norm_bound_mode={self.norm_bound_mode!r})")

    def configure_fit(
        self, server_round: int, current: Weights, clients: Sequence[ClientInfo]
    ) -> FitPlan:
        plan = self.inner.configure_fit(server_round, current, clients)
        config = {**plan.config, MAX_UPDATE_NORM: self.max_update_norm,
                  NORM_BOUND_MODE: self.norm_bound_mode}
        return FitPlan(plan.client_ids, config)

    def aggregate_fit(
        self, server_round: int, current: Weights, updates: Iterable[ClientUpdate]
    ) -> AggregateResult:
        clipped = rejected = 0

        def bounded() -> Iterator[ClientUpdate]:
            nonlocal clipped, rejected
            for update in updates:
                if self.norm_bound_mode == "reject":
                    if l2_norm(update.delta) <= self.max_update_norm:
                        yield update
                    else:
                        rejected += 1
                    continue
                outcome = clip_to_norm(update.delta, self.max_update_norm)
                if not outcome.clipped:
                    yield update
                    continue
                clipped += 1
                yield ClientUpdate(
                    update.client_id, outcome.weights,
                    update.num_examples, update.base_round, update.metrics,
                )

        result = self.inner.aggregate_fit(server_round, current, bounded())
        metrics = {**result.metrics, "num_clipped": clipped, "num_rejected": rejected}
        return AggregateResult(result.weights, metrics, num_updates=result.num_updates,
                               reason=result.reason)

    def configure_evaluate(
        self, server_round: int, current: Weights, clients: Sequence[ClientInfo]
    ) -> EvaluatePlan:
        return self.inner.configure_evaluate(server_round, current, clients)

    def aggregate_evaluate(self, server_round: int, results: Iterable[EvaluateResult]) -> Metrics:
        return self.inner.aggregate_evaluate(server_round, results)

    def state_dict(self) -> StateDict:
        return self.inner.state_dict()

    def load_state_dict(self, state: StateDict) -> None:
        self.inner.load_state_dict(state)
