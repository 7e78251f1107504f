"""The local engine: a federated run in one process, no Ray, no serialisation.

`run_local` drives a fedloom `Strategy` over simulated clients exactly as the Flower
bridge (`FlowerStrategy` under Flower's ``Strategy.start``) does, step for step:

1. round 0: ``evaluate_fn(0, initial)``;
2. each round r: ``configure_fit`` over `plan.client_infos` → each sampled client
   fits, in plan order, with `plan.client_fit_configs` (each ``seed`` from `fit_seed`) →
   its new weights become a delta (`plan.to_update`) → ``aggregate_fit``;
   ``configure_evaluate`` → ``aggregate_evaluate``; ``evaluate_fn(r, weights)``.

Same calls in the same order with the same configs give the same model as the Flower
engine, round for round (tests/simulations check it). A client that raises, or returns
unusable weights, is counted in ``num_failures`` and left out of the round. A round
whose aggregation raises `AggregationError` (Krum short of updates...) is recorded as
failed, with the reason, and the run goes on from the same model, as on the server.

With a ``clock`` (`fedloom.simulations.clock.SyncClock`) each round is timed on the
virtual clock: only the clients whose updates count (all sampled ones, or the first to
finish under over-selection) train, and each record carries ``virtual_time_s``. With
``evaluate_every`` > 1 the evaluations (federated and central) run every that many
rounds and in the last, as the server's ``rounds.evaluate_every``.

With ``secure_aggregation`` (a `fedloom.simulations.local_secure.LocalSecureAggregation`)
each fit round runs under SecAgg+ instead: the sampled clients train as above, then
the real SecAgg+ state machines run in-process and the strategy gets only the secure
mean (as `fedloom.server` hands it over).

Example::

    from fedloom.strategies import FedAvg, SelectionConfig
    from fedloom.simulations.local_engine import run_local

    strategy = FedAvg(selection=SelectionConfig(fraction_fit=0.1, seed=0))
    history = run_local(strategy, make_client, initial,
                        num_clients=100, num_rounds=20, base_seed=0)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from fedloom.client_sdk._client import Client
from fedloom.errors import AggregationError, PrivacyBudgetExhausted
from fedloom.simulations.clock import SyncClock
from fedloom.simulations.compression import CompressionSpec, SimulatedCompression
from fedloom.simulations.fitting import FitTask, RoundFitter, SerialFitter
from fedloom.simulations.history import (
    History,
    RoundRecord,
    RoundRecorder,
    with_privacy_spent,
)
from fedloom.simulations.plan import client_fit_configs, client_infos, to_update
from fedloom.strategies import Strategy
from fedloom.types import (
    AggregateResult,
    ClientInfo,
    ClientUpdate,
    EvaluateResult,
    FitPlan,
    Metrics,
    Scalar,
)
from fedloom.weights import Weights

if TYPE_CHECKING:
    from fedloom.simulations.local_secure import LocalSecureAggregation

logger = logging.getLogger(__name__)

ClientFactory = Callable[[int], Client]
EvaluateFn = Callable[[int, Weights], Metrics | None]


def run_local(
    strategy: Strategy,
    client_fn: ClientFactory,
    initial: Weights,
    *,
    num_clients: int,
    num_rounds: int,
    base_seed: int = 0,
    fit_defaults: Mapping[str, Scalar] | None = None,
    evaluate_fn: EvaluateFn | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_model: Callable[[Weights], None] | None = None,
    secure_aggregation: LocalSecureAggregation | None = None,
    clock: SyncClock | None = None,
    evaluate_every: int = 1,
    fitter: RoundFitter | None = None,
    compression: SimulatedCompression | None = None,
) -> History:
    """Run ``num_rounds`` rounds of ``strategy`` over clients ``0 .. num_clients - 1``.

    Args:
        strategy: any fedloom strategy (it samples and aggregates).
        client_fn: builds (or returns a cached) `Client` for a partition id.
        initial: the global model of round 0.
        num_clients: how many simulated clients exist.
        num_rounds: rounds to run.
        base_seed: the run seed behind each client's per-round ``seed``.
        fit_defaults: client settings sent with every fit (``local_epochs``, ``lr``...).
        evaluate_fn: central evaluation, ``(round, weights) -> metrics``.
        on_round: called with each finished `RoundRecord` (progress displays).
        on_model: called with each finished round's global model, before ``on_round``
            (what a run stopped early has made).
        secure_aggregation: run the fit rounds under SecAgg+ (see the module docstring).
        clock: time the rounds on a virtual clock (see the module docstring).
        evaluate_every: rounds between evaluations (the last round is always evaluated).
        fitter: how the sampled clients train (`fedloom.simulations.fitting`); by
            default one after another through ``client_fn``.
        compression: the codecs between clients and server
            (`fedloom.simulations.compression`); by default plain float32.

    Returns:
        The `History`: round 0 (initial evaluation) and one record per round, and the
        final weights.
    """
    if num_clients < 1 or num_rounds < 1 or evaluate_every < 1:
        raise ValueError("num_clients, num_rounds and evaluate_every must be at least 1")
    if secure_aggregation is not None:
        secure_aggregation.check(strategy)
    started = time.perf_counter()
    infos = client_infos(num_clients)
    recorder = RoundRecorder(on_round, on_model)
    fitter = fitter if fitter is not None else SerialFitter(client_fn)
    compression = compression if compression is not None else SimulatedCompression(
        CompressionSpec(), base_seed)
    current = initial
    recorder.finish(0, evaluate_fn(0, current) if evaluate_fn else None,
                    0.0 if clock is not None else None, current)
    for server_round in range(1, num_rounds + 1):
        try:
            plan = strategy.configure_fit(server_round, current, infos)
        except PrivacyBudgetExhausted as exc:  # before the round: nothing past it released
            logger.warning("run ends before round %d: %s", server_round, exc)
            break
        if secure_aggregation is not None:
            plan = secure_aggregation.limit(plan)
        num_sampled, num_cancelled = len(plan.client_ids), 0
        if clock is not None:  # over-selection: only the updates that count are trained
            timing = clock.round(server_round, plan.client_ids, infos)
            plan = FitPlan(timing.client_ids, plan.config)
            num_sampled, num_cancelled = timing.num_sampled, timing.num_cancelled
        failures: list[str] = []
        received = [0]
        updates = _counted(_fit_updates(
            fitter, plan, current, server_round, base_seed, fit_defaults, failures, compression
        ), received)
        try:
            if secure_aggregation is None:
                result = strategy.aggregate_fit(server_round, current, updates)
            else:
                result = secure_aggregation.aggregate_fit(
                    strategy, server_round, current, plan, updates, failures)
        except AggregationError as exc:  # the server's rule: the round failed, the run goes on
            result = AggregateResult.failed(exc, received[0])
        result = with_privacy_spent(result, strategy)
        recorder.fit(result, len(failures), num_sampled=num_sampled,
                     num_cancelled=num_cancelled,
                     traffic=compression.traffic() if secure_aggregation is None else None,
                     num_updates=received[0] if result.weights is None else None)
        if result.weights is not None:
            current = result.weights
        else:
            logger.warning("round %d failed: %s; the global model is unchanged", server_round,
                           result.reason)

        central = None
        if server_round % evaluate_every == 0 or server_round == num_rounds:
            federated = federated_evaluate(strategy, client_fn, server_round, current, infos)
            if federated is not None:
                recorder.evaluate(federated)
            central = evaluate_fn(server_round, current) if evaluate_fn else None
        recorder.finish(server_round, central, clock.now if clock is not None else None,
                        current)
    return History("local", recorder.records, current, time.perf_counter() - started)


def federated_evaluate(
    strategy: Strategy, client_fn: ClientFactory, server_round: int, current: Weights,
    clients: Sequence[ClientInfo],
) -> Metrics | None:
    """The strategy's federated evaluation over ``clients``; None when it asks no one or
    every client it asked failed."""
    eval_plan = strategy.configure_evaluate(server_round, current, clients)
    results = []
    for cid in eval_plan.client_ids:
        try:
            out = client_fn(int(cid)).evaluate(current, eval_plan.config)
            results.append(EvaluateResult(cid, out.num_examples, out.loss, out.metrics))
        except Exception as exc:
            logger.warning("client %s failed to evaluate: %s", cid, exc)
    return strategy.aggregate_evaluate(server_round, results) if results else None


def _counted(updates: Iterator[ClientUpdate], count: list[int]) -> Iterator[ClientUpdate]:
    """``updates``, counting in ``count[0]`` those the strategy took (a failed
    aggregation's record still says how many updates came in)."""
    for update in updates:
        count[0] += 1
        yield update


def _fit_updates(
    fitter: RoundFitter,
    plan: FitPlan,
    current: Weights,
    server_round: int,
    base_seed: int,
    fit_defaults: Mapping[str, Scalar] | None,
    failures: list[str],
    compression: SimulatedCompression,
) -> Iterator[ClientUpdate]:
    """Fit the plan's clients with ``fitter`` from the round's broadcast, yielding their
    updates, as the server decodes them, in plan order.

    Lazy, so a streaming aggregator holds one update at a time (as many as the fitter
    trains at once). A client that fails is appended to ``failures`` and skipped.
    """
    received = compression.broadcast(current)
    indices = [int(cid) for cid in plan.client_ids]
    configs = client_fit_configs(plan.config, base_seed=base_seed, client_indices=indices,
                                 server_round=server_round, defaults=fit_defaults)
    tasks = [FitTask(index, config) for index, config in zip(indices, configs, strict=True)]
    for cid, out in zip(plan.client_ids, fitter.fit(received, tasks), strict=True):
        try:
            if isinstance(out, Exception):
                raise out
            update = compression.update(
                to_update(cid, out.weights, out.num_examples, out.metrics, received,
                          server_round), int(cid), server_round)
        except Exception as exc:  # a failed client is data, not the end of the round
            logger.warning("client %s failed in round %d: %s", cid, server_round, exc)
            failures.append(cid)
            continue
        yield update
