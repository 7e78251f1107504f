"""Buffered asynchronous aggregation (FedBuff) on the local engine, as an event simulation.

Nguyen et al., AISTATS 2022 ("Federated Learning with Buffered Asynchronous
Aggregation"), run the way `fedloom.server.async_rounds` runs it, with time taken from
the clients' speeds (`fedloom.simulations.speed`) instead of the wall clock:

1. ``rounds.concurrency`` clients, a seeded sample of the idle ones (the server's rule:
   ``random.Random(seed).sample`` over the idle clients ordered by name), start training
   model version 0. A task's finish time is its start plus the client's fit duration.
2. The earliest task to finish (ties: the earlier issued) is taken. Its staleness is
   the current version minus the version it trained on; beyond ``rounds.max_staleness``
   it is refused, and its fit is not even run (its result could only be thrown away).
   Otherwise the client's fit runs now, on the weights of the version it started from
   (kept while a task still needs them), and its delta joins the buffer with
   ``metrics["staleness"]`` set and ``base_round`` = that version.
3. When the buffer holds ``rounds.buffer_size`` (K) updates, the strategy steps exactly
   as the server's does: ``aggregate_fit(version + 1, current,
   weighted_updates(buffer, weighting))``; the result is the next version. A step takes
   no virtual time (the server's step takes milliseconds against fits of seconds).
4. The returned client is idle at once; idle clients are sampled until
   ``concurrency`` train, on the newest version (with ``rounds.max_updates_per_client``,
   only those with fewer updates than that in the open buffer, as the server does).

Versions count as rounds: ``num_rounds`` of them, fewer when ``rounds.total_updates``
ends the run first (`RoundsConfig.last_round`); every ``rounds.evaluate_every`` versions
and the last are evaluated (federated evaluation asks idle clients only, as the server
does). Each record carries ``virtual_time_s``; ``num_failures`` counts the refused and
failed results of its buffer, ``num_sampled`` = K + ``num_failures`` (the server's
counts). A client's fit seed is `fit_seed` of its own task number, not of the version:
a client may train twice on one version and should not repeat the same update.

Differences from the server, said plainly: the buffer's K updates are held in memory
(the server spools them to disk); a task issued while the server aggregates trains the
old model there but the new one here (the step is instantaneous); there are no
deadlines, transfers or dropped connections.

Example::

    speed = SpeedModel.from_spec(SpeedSpec(distribution="lognormal",
                                           straggler_fraction=0.2), num_clients=100, seed=0)
    history = run_local_async(FedAvg(), client_fn, initial, num_clients=100,
                              num_rounds=200, speed=speed,
                              rounds=RoundsConfig(mode="async", concurrency=20,
                                                  buffer_size=10))
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping

from fedloom.config import RoundsConfig
from fedloom.errors import AggregationError, ConfigError
from fedloom.simulations.history import (
    History,
    RoundRecord,
    RoundRecorder,
    with_privacy_spent,
)
from fedloom.simulations.local_engine import ClientFactory, EvaluateFn, federated_evaluate
from fedloom.simulations.plan import client_fit_config, client_infos, to_update
from fedloom.simulations.speed import SpeedModel
from fedloom.strategies import StalenessWeighting, Strategy, check_robust_async, weighted_updates
from fedloom.types import AggregateResult, ClientUpdate, Scalar
from fedloom.weights import Weights

logger = logging.getLogger(__name__)

#: Results that may fail in a row, per client, before the run is given up: a federation
#: whose every client fails would otherwise never take a step.
FAILURES_PER_CLIENT = 10


@dataclasses.dataclass(frozen=True)
class _Task:
    client: int
    version: int  # the model version it trains on
    number: int  # the client's task number, from 1 (keys its fit time and seed)
    config: Mapping[str, Scalar]


class _AsyncRun:
    """The state of one asynchronous simulation (see the module docstring)."""

    def __init__(self, strategy: Strategy, client_fn: ClientFactory, initial: Weights, *,
                 num_clients: int, num_rounds: int, rounds: RoundsConfig, speed: SpeedModel,
                 base_seed: int, fit_defaults: Mapping[str, Scalar] | None,
                 evaluate_fn: EvaluateFn | None,
                 on_round: Callable[[RoundRecord], None] | None,
                 on_model: Callable[[Weights], None] | None = None) -> None:
        self.strategy, self.client_fn, self.speed = strategy, client_fn, speed
        self.rounds, self.base_seed = rounds, base_seed
        self.fit_defaults, self.evaluate_fn = fit_defaults, evaluate_fn
        self.weighting = StalenessWeighting.from_config(rounds)
        self.last = rounds.last_round(num_rounds)
        self.infos = client_infos(num_clients)
        self.recorder = RoundRecorder(on_round, on_model)
        self.rng = random.Random(base_seed)  # the server's idle-client sampler
        self.now = 0.0
        self.version, self.current = 0, initial
        self.models: dict[int, Weights] = {0: initial}  # versions tasks still train on
        self.in_use: Counter[int] = Counter()  # version -> tasks training on it
        self.pending: list[tuple[float, int, _Task]] = []  # (finish, issue order, task)
        self.busy: set[int] = set()
        self.tasks_of: Counter[int] = Counter()  # client -> tasks issued to it
        self.issued = 0
        self.plan_config: tuple[int, Mapping[str, Scalar]] | None = None
        self.buffer: list[ClientUpdate] = []
        self.num_failures = 0  # refused or failed results of the open buffer
        self.failures_in_row = 0

    def run(self) -> None:
        central = self.evaluate_fn(0, self.current) if self.evaluate_fn else None
        self.recorder.finish(0, central, 0.0, self.current)
        self.top_up()
        while self.version < self.last:
            finish, _, task = heapq.heappop(self.pending)
            self.now = finish
            self.busy.discard(task.client)
            self.take(task)
            self.in_use[task.version] -= 1
            self.release(task.version)
            if len(self.buffer) == self.rounds.buffer_size:
                self.step()
            if self.version < self.last:
                self.top_up()

    def take(self, task: _Task) -> None:
        """The result of ``task``: refused when too stale, else fitted into the buffer."""
        staleness = self.version - task.version
        cid = self.infos[task.client].client_id
        if staleness > self.rounds.max_staleness:
            logger.debug("client %s: update on version %d refused, %d versions old", cid,
                         task.version, staleness)
            self.num_failures += 1
            return
        base = self.models[task.version]
        try:
            out = self.client_fn(task.client).fit(base, task.config)
            update = to_update(cid, out.weights, out.num_examples, out.metrics, base,
                               task.version + 1)
        except Exception as exc:  # a failed client is data, not the end of the run
            logger.warning("client %s failed on version %d: %s", cid, task.version, exc)
            self.num_failures += 1
            self.failures_in_row += 1
            if self.failures_in_row > FAILURES_PER_CLIENT * len(self.infos):
                raise RuntimeError(f"the last {self.failures_in_row} fits all failed; the "
                                   "asynchronous run cannot take a step") from exc
            return
        self.failures_in_row = 0
        metrics = {**update.metrics, "staleness": staleness}
        self.buffer.append(dataclasses.replace(update, metrics=metrics))

    def step(self) -> None:
        """The buffer is full: the strategy's step makes the next version."""
        server_round = self.version + 1
        try:
            result = self.strategy.aggregate_fit(server_round, self.current,
                                                 weighted_updates(self.buffer, self.weighting))
        except AggregationError as exc:  # the server's rule: the version failed, go on
            result = AggregateResult.failed(exc, len(self.buffer))
        result = with_privacy_spent(result, self.strategy)
        self.recorder.fit(result, self.num_failures,
                          num_sampled=len(self.buffer) + self.num_failures)
        self.buffer, self.num_failures = [], 0
        self.version = server_round
        if result.weights is not None:
            self.current = result.weights
        else:
            logger.warning("version %d failed: %s; the global model is unchanged",
                           server_round, result.reason)
        self.models[server_round] = self.current
        self.release(server_round - 1)
        central = None
        if result.weights is not None and self.rounds.evaluates(server_round, self.last):
            idle = [info for i, info in enumerate(self.infos) if i not in self.busy]
            federated = federated_evaluate(self.strategy, self.client_fn, server_round,
                                           self.current, idle)
            if federated is not None:
                self.recorder.evaluate(federated)
            central = self.evaluate_fn(server_round, self.current) if self.evaluate_fn else None
        self.recorder.finish(server_round, central, self.now, self.current)

    def top_up(self) -> None:
        """Start idle clients until ``concurrency`` train (the server's `_top_up`)."""
        need = self.rounds.concurrency - len(self.busy)
        if need <= 0:
            return
        idle = [info for i, info in enumerate(self.infos) if i not in self.busy]
        cap = self.rounds.max_updates_per_client
        if cap:  # the server's rule: at most cap updates from one client in a buffer
            held = Counter(update.client_id for update in self.buffer)
            idle = [info for info in idle if held[info.client_id] < cap]
        chosen = idle if len(idle) <= need else self.rng.sample(idle, need)
        for info in chosen:
            self.issue(int(info.client_id))

    def issue(self, client: int) -> None:
        self.tasks_of[client] += 1
        number = self.tasks_of[client]
        config = client_fit_config(self.fit_config(), base_seed=self.base_seed,
                                   client_index=client, server_round=number,
                                   defaults=self.fit_defaults)
        task = _Task(client, self.version, number, config)
        finish = self.now + self.speed.duration(client, number)
        heapq.heappush(self.pending, (finish, self.issued, task))
        self.issued += 1
        self.busy.add(client)
        self.in_use[self.version] += 1

    def fit_config(self) -> Mapping[str, Scalar]:
        """The strategy's fit config for tasks on the current version, asked once per
        version as the server asks it."""
        server_round = self.version + 1
        if self.plan_config is None or self.plan_config[0] != server_round:
            plan = self.strategy.configure_fit(server_round, self.current, self.infos)
            self.plan_config = (server_round, plan.config)
        return self.plan_config[1]

    def release(self, version: int) -> None:
        """Forget a version's weights once no task trains on it and it is not current."""
        if self.in_use[version] <= 0 and version != self.version:
            self.models.pop(version, None)
            self.in_use.pop(version, None)


def run_local_async(
    strategy: Strategy,
    client_fn: ClientFactory,
    initial: Weights,
    *,
    num_clients: int,
    num_rounds: int,
    rounds: RoundsConfig,
    speed: SpeedModel,
    base_seed: int = 0,
    fit_defaults: Mapping[str, Scalar] | None = None,
    evaluate_fn: EvaluateFn | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_model: Callable[[Weights], None] | None = None,
) -> History:
    """Run FedBuff over clients ``0 .. num_clients - 1`` (see the module docstring).

    Args:
        strategy: any mean-based fedloom strategy (it aggregates each buffer).
        client_fn: builds (or returns a cached) `Client` for a partition id.
        initial: model version 0.
        num_clients: how many simulated clients exist.
        num_rounds: versions to make (fewer when ``rounds.total_updates`` ends it first).
        rounds: the ``[rounds]`` settings; ``mode`` must be ``"async"``.
        speed: the clients' fit durations on the virtual clock.
        base_seed: seeds the idle-client sampler and each task's fit ``seed``.
        fit_defaults: client settings sent with every fit (``local_epochs``...).
        evaluate_fn: central evaluation, ``(version, weights) -> metrics``.
        on_round: called with each finished `RoundRecord` (progress displays).
        on_model: called with each finished version's global model, before ``on_round``.

    Returns:
        The `History`: version 0 (initial evaluation) and one record per version.
    """
    if not rounds.asynchronous:
        raise ValueError('run_local_async needs rounds.mode = "async"')
    if num_clients < 1 or num_rounds < 1:
        raise ValueError("num_clients and num_rounds must be at least 1")
    if speed.num_clients < num_clients:
        raise ValueError(f"the speed model has {speed.num_clients} clients, the run "
                         f"{num_clients}")
    cap = rounds.max_updates_per_client
    if cap and num_clients * cap < rounds.buffer_size:
        raise ConfigError("rounds.max_updates_per_client",
                          f"{cap} update(s) from each of {num_clients} clients cannot fill a "
                          f"buffer of rounds.buffer_size = {rounds.buffer_size}: raise it, "
                          "or lower buffer_size")
    check_robust_async(strategy, rounds)
    started = time.perf_counter()
    run = _AsyncRun(strategy, client_fn, initial, num_clients=num_clients,
                    num_rounds=num_rounds, rounds=rounds, speed=speed, base_seed=base_seed,
                    fit_defaults=fit_defaults, evaluate_fn=evaluate_fn, on_round=on_round,
                    on_model=on_model)
    run.run()
    return History("local", run.recorder.records, run.current, time.perf_counter() - started)
