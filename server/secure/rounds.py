"""Secure fit rounds: SecAgg+ (Bell et al., CCS 2020; Bonawitz et al., CCS 2017) in the
server's real rounds.

With ``[secure_aggregation] enabled``, the coordinator hands each fit round to
`SecureRounds.run_round`: it samples among the clients that joined with the ``secagg``
capability, runs one round attempt (`fedloom.server.secure.attempt.SecureAttempt`)
stage by stage — each stage with its own deadline, closed as soon as no connected
client owes a reply — and gets back only the weighted mean over the survivors. That
mean is the aggregate of the strategy's round: it is handed, as the round's one
update, to the strategy's own ``aggregate_fit``, so FedAvg, FedAvgM, FedProx and the
FedOpt family apply their ServerOptimizer to it as usual (their weighted-mean
aggregator of one update returns it unchanged). Strategies whose aggregator needs the
individual updates (median, trimmed mean, Krum, Bulyan) are refused when the server is
built (`check_secure_strategy`); a norm bound becomes clipping on the client. Both steps
live in `fedloom.strategies` (`aggregate_secure_mean`), which the local engine shares.

Key offers: each client's share-keys reply offers fresh keys for its next attempt
(`fedloom.secagg.KeyOffer`); they are kept here, per connected client, and each is
handed to one attempt only. A round whose participants all have one skips the
advertise keys stage (three round trips instead of four); a client without one (just
joined, or its offer was used by a failed attempt) advertises as usual. Offers live in
memory: after a server restart every client advertises once again.

Dropouts: a client that leaves, stops its heartbeats, or whose long-poll stream breaks
is dropped from the attempt at once (`drop`), not only at the stage's deadline. A round
that cannot finish (too few survivors) fails cleanly: the global model is unchanged,
the round is committed as failed and the next one starts. Every attempt has a new
attempt id (microseconds of the wall clock, strictly increasing in a process), so a
round run again after a server restart never reuses one, and clients make fresh keys.

What the server learns: the sum of the survivors' clipped, weighted deltas, the sum of
their weights (hence of their examples), and who survived. Per-client fit metrics are
not sent under secure aggregation; the round's fit metrics hold only those sums.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

from fedloom.config import ServerConfig
from fedloom.errors import ConfigError, MessageRejectedError, RejectReason, SecureAggregationError
from fedloom.messages import ResultHeader, TaskHeader
from fedloom.payload import PayloadInfo
from fedloom.secagg import KeyOffer, RoundId, RoundSetup, SecAggResult, SecAggStatus, Stage
from fedloom.server.crashpoints import crashpoint
from fedloom.server.registry import ClientRecord, ClientRegistry
from fedloom.server.secure.attempt import (
    EMPTY_PAYLOAD,
    SecureAttempt,
    StageTask,
    stage_deadline_s,
)
from fedloom.server.uploads import Spool, SpooledWeights
from fedloom.strategies import Strategy, aggregate_secure_mean
from fedloom.types import AggregateResult
from fedloom.weights import Weights

log = logging.getLogger("fedloom.server")

#: The capability a client sends in Join when it can run SecAgg+ stages.
SECAGG_CAPABILITY = "secagg"
__all__ = ["SECAGG_CAPABILITY", "SecureRounds"]


class SecureRounds:
    """Runs the secure fit rounds of one coordinator and relays their stage traffic."""

    def __init__(self, config: ServerConfig, run_id: str, registry: ClientRegistry,
                 executor: concurrent.futures.ThreadPoolExecutor, spool_dir: Path) -> None:
        self.config = config
        self.secagg = config.secure_aggregation
        self.run_id = run_id
        self.registry = registry
        self._executor = executor
        self._spool_dir = spool_dir
        # The final unmasking runs over ranges of the vector in parallel (threads are
        # made when first needed).
        self._unmask_pool = concurrent.futures.ThreadPoolExecutor(
            min(4, os.cpu_count() or 1), thread_name_prefix="unmask")
        self._attempt: SecureAttempt | None = None
        self._previous: SecureAttempt | None = None  # answers late results of the last one
        self._last_attempt = 0
        self._offers: dict[str, KeyOffer] = {}  # client id -> its unused key offer
        #: What the server learned in the last secure round that succeeded (sums only).
        self.last_result: SecAggResult | None = None
        #: The public parameters of the last attempt (its round id, participants, ...).
        self.last_setup: RoundSetup | None = None
        #: Wall seconds of each stage of the last attempt (also in the round's record).
        self.last_stage_s: dict[str, float] = {}

    @property
    def enabled(self) -> bool:
        return self.secagg.enabled

    @property
    def running(self) -> tuple[int, Stage] | None:
        """(round, stage) of the attempt in progress, or None (safe from any thread)."""
        attempt = self._attempt
        return None if attempt is None else (attempt.setup.round_id.server_round,
                                             attempt.machine.stage)

    # -- relayed by the coordinator --------------------------------------------------
    def owns(self, task_id: str) -> bool:
        attempt = self._attempt
        return any(a is not None and task_id in a.tasks for a in (attempt, self._previous))

    def offer(self, client_id: str) -> tuple[TaskHeader, memoryview] | None:
        attempt = self._attempt
        task = attempt.offer(client_id) if attempt is not None else None
        return (task.header, task.payload) if task is not None else None

    def drop(self, client_id: str, reason: str) -> None:
        if self._attempt is not None:
            self._attempt.drop(client_id, reason)

    async def begin_result(self, record: ClientRecord, header: ResultHeader
                           ) -> tuple[StageTask, Spool] | bool:
        for attempt in (self._attempt, self._previous):
            if attempt is not None and header.task_id in attempt.tasks:
                return await attempt.begin_result(record.client_id, header)
        raise MessageRejectedError(RejectReason.STALE, "the secure round of that task has ended")

    async def finish_upload(self, task: StageTask, header: ResultHeader, spool: Spool,
                            delta: SpooledWeights | None) -> None:
        attempt = self._attempt
        if attempt is None or attempt.tasks.get(task.task_id) is not task:
            task.in_flight = False
            spool.discard()
            if delta is not None:
                raise MessageRejectedError(RejectReason.STALE, "the secure round has ended")
            return
        await attempt.finish_masked_input(task, header, spool, delta)

    # -- one round ----------------------------------------------------------------------
    def _next_attempt(self) -> int:
        self._last_attempt = max(self._last_attempt + 1, time.time_ns() // 1000)
        return self._last_attempt

    async def _eligible(self) -> list[Any]:
        """Connected clients that can run SecAgg+, once at least min_fit_clients are."""
        while True:
            eligible = [c for c in self.registry.infos() if SECAGG_CAPABILITY in c.capabilities]
            if len(eligible) >= self.config.min_fit_clients:
                return eligible
            log.info("secure round waits: %d of %d clients support secure aggregation",
                     len(eligible), self.config.min_fit_clients)
            self.registry.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.registry.changed.wait(), 5.0)

    async def run_round(self, server_round: int, current: Weights, strategy: Strategy,
                        payload: memoryview, payload_info: PayloadInfo
                        ) -> tuple[AggregateResult | None, dict[str, Any]]:
        """Run one secure fit round; returns the strategy's result (None: failed) and
        the round's record."""
        eligible = await self._eligible()
        plan = strategy.configure_fit(server_round, current, eligible)
        participants = tuple(c for c in plan.client_ids if c in self.registry)
        participants = participants[: self.secagg.max_participants]
        record: dict[str, Any] = {"round": server_round, "num_sampled": len(participants),
                                  "num_updates": 0, "num_failures": len(participants)}
        vector_length = sum(spec.size for spec in current.specs())
        try:
            setup = RoundSetup.create(
                self.secagg, RoundId(self.run_id, server_round, self._next_attempt()),
                participants, vector_length)
        except ConfigError as exc:
            log.warning("secure round %d cannot start: %s", server_round, exc)
            record["secure_aggregation"] = {"failure": str(exc)}
            return None, record
        self.last_setup = setup
        outcome = await self._run_attempt(setup, payload, payload_info, plan.config)
        info: dict[str, Any] = {"attempt": setup.round_id.attempt,
                                "stage_s": {k: round(v, 4) for k, v in self.last_stage_s.items()}}
        record["secure_aggregation"] = info
        if isinstance(outcome, str):
            log.warning("secure round %d failed: %s; the global model is unchanged",
                        server_round, outcome)
            info["failure"] = outcome
            return None, record
        self.last_result = outcome
        survivors = len(outcome.survivors)
        total_examples = round(outcome.total_examples)
        record.update(num_updates=survivors, num_failures=len(participants) - survivors)
        info.update(survivors=survivors, dropped=len(outcome.dropped),
                    total_examples=total_examples)
        result = await self._apply(strategy, server_round, current, outcome)
        return result, record

    async def _run_attempt(self, setup: RoundSetup, payload: memoryview,
                           payload_info: PayloadInfo, fit_config: Any) -> SecAggResult | str:
        """Run the stages of one attempt; its result, or why it failed."""
        self._offers = {c: o for c, o in self._offers.items() if c in self.registry}
        offers = {c: self._offers.pop(c) for c in setup.participants if c in self._offers}
        attempt = SecureAttempt(setup, self.config, payload, payload_info, fit_config,
                                self._executor, self._wake, self._spool_dir,
                                self._unmask_pool.map, offers)
        self._attempt = attempt
        self.last_stage_s = {}
        try:
            while attempt.machine.status is SecAggStatus.RUNNING:
                started = time.monotonic()
                stage = await attempt.open_stage()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(attempt.complete.wait(),
                                           stage_deadline_s(self.config, stage))
                answered, issued = attempt.counts()
                attempt.close_stage()
                await attempt.call(attempt.machine.advance)  # the last one unmasks
                self.last_stage_s[str(stage)] = time.monotonic() - started
                crashpoint("mid_secure_aggregation")  # recovery tests: a kill between stages
                log.info("secure round %d: %s closed after %.2f s (%d/%d answered)",
                         setup.round_id.server_round, stage, time.monotonic() - started,
                         answered, issued)
            return attempt.machine.result
        except SecureAggregationError as exc:
            return str(exc)
        finally:
            attempt.close_stage()
            for task in attempt.tasks.values():
                task.payload = EMPTY_PAYLOAD  # keep no old model alive
            self._offers.update(attempt.machine.new_offers)  # unused: for a later attempt
            self._previous, self._attempt = attempt, None

    def _wake(self, client_id: str) -> None:
        client = self.registry.get(client_id)
        if client is not None:
            client.wakeup.set()

    async def _apply(self, strategy: Strategy, server_round: int, current: Weights,
                     outcome: SecAggResult) -> AggregateResult:
        """The strategy's step with the secure mean (`aggregate_secure_mean`), off the loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, aggregate_secure_mean, strategy,
                                          server_round, current, outcome)
