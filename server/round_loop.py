"""The round loop: rounds ``next_round..num_rounds``, each run by the round driver, then
committed and evaluated.

Each round: wait for ``min_clients``; the driver runs the fit (`fedloom.server.driver`);
a new model is published (its broadcast built in the aggregation thread:
`fedloom.server.model`), the round is committed (checkpoint, then SQLite:
`fedloom.server.persistence`), then the model is evaluated (federated, then
server-side; every ``rounds.evaluate_every`` rounds and the last) and the evaluation is
recorded in the committed round. A server stopped between the two evaluates the
committed model when it resumes. A failed round leaves the global model unchanged and
the next round starts. A spent privacy budget ends the
run before the round that would exceed it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from fedloom.errors import PrivacyBudgetExhausted
from fedloom.records import RoundRecord
from fedloom.server.async_rounds import AsyncRounds
from fedloom.server.client_metrics import why_not_per_client
from fedloom.server.compression import download_grants
from fedloom.server.driver import FitOutcome, RoundDriver, RoundParts
from fedloom.server.evaluation import EvaluateFn, federated_evaluate, server_evaluate
from fedloom.server.metrics import ServerMetrics
from fedloom.server.model import Grant
from fedloom.server.persistence import RunPersistence
from fedloom.server.plain_round import PlainRounds
from fedloom.server.secure import SecureRounds
from fedloom.strategies import privacy_spent_metrics

log = logging.getLogger("fedloom.server")


def round_driver(parts: RoundParts, persistence: RunPersistence) -> RoundDriver:
    """The driver the configuration asks for: the one place that chooses."""
    if parts.config.rounds.asynchronous:
        return AsyncRounds(parts, persistence)
    if parts.config.secure_aggregation.enabled:
        return SecureRounds(parts)
    return PlainRounds(parts)


class RoundLoop:
    """Runs and commits the rounds of one run (see the module docstring)."""

    def __init__(self, parts: RoundParts, driver: RoundDriver, persistence: RunPersistence,
                 evaluate_fn: EvaluateFn | None = None) -> None:
        self.parts = parts
        self.driver = driver
        self.persistence = persistence
        self.evaluate_fn = evaluate_fn
        self.history: list[RoundRecord] = persistence.history()
        self.next_round = persistence.completed_round + 1
        # Whether a due evaluation has anything to run: the flag a commit leaves for a
        # restart (a strategy without selection settings may always evaluate).
        selection = getattr(getattr(parts.strategy, "inner", parts.strategy), "selection", None)
        self._federated = selection is None or selection.fraction_evaluate > 0
        self._may_evaluate = evaluate_fn is not None or self._federated
        self.stopped_reason = ""  # why the run ended before num_rounds (the privacy budget)
        unkept = why_not_per_client(parts.config, parts.strategy)
        if unkept and parts.config.metrics.per_client:
            log.info("per-client metrics are not recorded: %s", unkept)

    def _grants(self) -> set[Grant]:
        return download_grants(self.parts.fleet.registry)

    @property
    def over(self) -> bool:
        """Nothing is left to run: the run finished, or all its rounds are committed
        (a server killed after its last commit, and started again)."""
        last = self.parts.config.rounds.last_round(self.parts.config.num_rounds)
        return self.persistence.finished or self.next_round > last

    async def run(self) -> None:
        """Run the remaining rounds; returns when the last one is committed."""
        parts = self.parts
        if self.next_round == 1 and not self.history and not self.over:
            initial = await server_evaluate(parts, self.evaluate_fn, 0, parts.model.weights)
            if initial:
                self.history.append(RoundRecord(0, server=initial))
                parts.reporter.round_finished(self.history[-1])
        if not self.persistence.finished and self.history and self.history[-1].evaluation_pending:
            await self._evaluate_pending()
        last = parts.config.rounds.last_round(parts.config.num_rounds)
        first = last + 1 if self.persistence.finished else self.next_round
        for server_round in range(first, last + 1):
            try:
                outcome, started = await self._fit(server_round)
            except PrivacyBudgetExhausted as exc:
                # Raised before the round's tasks go out: the last committed round is
                # the run's final model, and nothing past the budget is released.
                if any(r.round > 0 and r.status == "ok" for r in self.history):
                    log.warning("run ends before round %d: %s", server_round, exc)
                else:  # the budget allows no round at all: a setting to fix, said so
                    log.error("run ends before round %d: %s; the budget allows no round of "
                              "this run, so its final model is the initial one: raise "
                              "privacy.noise_multiplier (fedloom privacy calibrate finds "
                              "one) or privacy.target_epsilon", server_round, exc)
                self.stopped_reason = str(exc)
                break
            await self._conclude(server_round, started, outcome)
            # Its aggregate is a model-sized array apart from the installed model (which
            # lives in the broadcast payload): not kept through the next round.
            del outcome
        self.driver.finish()
        if not self.persistence.finished:
            loop = asyncio.get_running_loop()
            path = await loop.run_in_executor(parts.executor, self.persistence.write_model,
                                              parts.model.weights)
            log.info("final model written to %s", path)
            self._say_if_nothing_trained()
        self.persistence.finish()

    def _say_if_nothing_trained(self) -> None:
        """A run whose every round failed ends like any other (its rounds are over), but
        its final model is the initial one: say so loudly, with the last round's reason
        (a client model that does not fit the server's, a rule's precondition, ...)."""
        trained = [r for r in self.history if r.round > 0]
        if trained and all(r.status == "failed" for r in trained):
            log.error("the run is over, but none of its %d rounds produced a model: the final "
                      "model is the initial one (last round: %s)", len(trained),
                      trained[-1].reason or "no reason recorded")

    async def _fit(self, server_round: int) -> tuple[FitOutcome, float]:
        """The round's fit, and when its first sample was drawn (the wait for
        ``min_clients`` before it is not the round's time); a failed one is run again
        ``round_retries`` times (a new sample and new tasks; asynchronous versions are
        not retried: the buffer goes on)."""
        config = self.parts.config
        retries = 0 if config.rounds.asynchronous else config.round_retries
        started: float | None = None
        for attempt in range(retries + 1):
            await self.parts.fleet.wait_for(config.min_clients)
            started = time.time() if started is None else started
            # Sessions that joined since the version was published (all of them, for
            # the initial model): their broadcasts are built off the loop too.
            await self.parts.model.prepare(self._grants, self.parts.executor)
            outcome = await self.driver.run_fit(server_round)
            if outcome.result is not None and outcome.result.weights is not None:
                break
            if attempt < retries:  # not committed: its reason is said here or nowhere
                reason = outcome.result.reason if outcome.result is not None else "no result"
                log.warning("round %d failed: %s; running it again (%d of %d retries)",
                            server_round, reason, attempt + 1, retries)
        assert started is not None  # the loop runs at least once
        return outcome, started

    async def _conclude(self, server_round: int, started: float, outcome: FitOutcome) -> None:
        """Install the new model (if any) and commit the round; then evaluate the model
        and record the evaluation in the committed round."""
        parts, result = self.parts, outcome.result
        sections: dict[str, Any] = {}
        weights = result.weights if result is not None else None
        trained = weights is not None
        last = parts.config.rounds.last_round(parts.config.num_rounds)
        evaluates = parts.config.rounds.evaluates(server_round, last)
        if weights is not None:
            # Built in the aggregation thread before any task can carry it; the last
            # version is broadcast only to a federated evaluation.
            await parts.model.publish(
                weights, server_round, self._grants, parts.executor,
                prepare=server_round < last or (evaluates and parts.config.fraction_evaluate > 0))
            sections["fit"] = dict(result.metrics) if result is not None else {}
        else:
            if result is not None:
                log.warning("round %d failed: %s; the global model is unchanged",
                            server_round, result.reason)
                sections["reason"] = result.reason
            # What the strategy said of a round without a model (the norm bound's
            # num_rejected, say), and, in a private run, the ε spent so far: a round that
            # failed after its release (a distributed-DP sum unmasked, then refused) has
            # spent budget, and the last round must never understate it.
            sections["fit"] = {**(dict(result.metrics) if result is not None else {}),
                               **privacy_spent_metrics(parts.strategy)}
            await parts.model.prepare(self._grants, parts.executor)
            parts.model.version = server_round  # the same weights, committed as this round
            evaluates = False
        self.driver.model_ready(server_round)
        record = RoundRecord(
            server_round, "ok" if trained else "failed",
            num_sampled=outcome.num_sampled, num_updates=outcome.num_updates,
            num_failures=outcome.num_failures, num_cancelled=outcome.num_cancelled,
            secure_aggregation=outcome.secure_aggregation, duration_s=time.time() - started,
            evaluation_pending=evaluates and self._may_evaluate, **sections)
        # Committed before the model goes to an evaluation: a server stopped while its
        # clients evaluate keeps the round (and, in a private run, the ledger that paid
        # for it) instead of running it again.
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(
            parts.executor, self.persistence.commit, record, parts.model.weights,
            parts.strategy.state_dict(), started, outcome.clients)
        self.driver.committed(server_round)
        self.history.append(record)  # committed: in the history even if a stop comes now
        epsilon = record.fit.get("privacy_epsilon")
        ServerMetrics.round_done(record.status, record.duration_s, record.round,
                                 float(epsilon) if isinstance(epsilon, int | float) else None)
        if evaluates:
            record = await self._evaluate(record)
        self.parts.reporter.round_finished(record)

    async def _evaluate(self, record: RoundRecord) -> RoundRecord:
        """Evaluate the committed round ``record`` (the history's last) — federated,
        then on the server — and record the evaluation in the round."""
        parts = self.parts
        if self._federated:
            # Sessions that joined since the version was published (during the commit,
            # or before a restart) get their broadcasts built off the loop too.
            await parts.model.prepare(self._grants, parts.executor)
        evaluate, clients = await federated_evaluate(parts, record.round)
        server = await server_evaluate(parts, self.evaluate_fn, record.round,
                                       parts.model.weights)
        if not (record.evaluation_pending or evaluate or server or clients):
            return record  # nothing ran: the committed record stands
        record = dataclasses.replace(record, evaluate=evaluate, server=server,
                                     evaluation_pending=False)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(parts.executor, self.persistence.record_evaluation, record,
                                   clients)
        self.history[-1] = record
        return record

    async def _evaluate_pending(self) -> None:
        """A server stopped between a round's commit and its evaluation's record: the
        committed model (the one loaded) is evaluated now, before the next round."""
        parts, record = self.parts, self.history[-1]
        log.info("round %d was committed but not evaluated; evaluating it", record.round)
        if self._federated:
            await parts.fleet.wait_for(parts.config.min_clients)
        # Its commit was counted in the metrics of the process that made it.
        self.parts.reporter.round_finished(await self._evaluate(record))
