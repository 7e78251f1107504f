"""Secure fit rounds: SecAgg+ (Bell et al., CCS 2020; Bonawitz et al., CCS 2017) in the
server's real rounds.

With ``[secure_aggregation] enabled``, the round loop runs each fit round with this
round driver (`fedloom.server.driver`), `SecureRounds.run_fit`: it samples among the
clients that joined with the ``secagg`` capability and runs round attempts
(`fedloom.server.secure.attempt.SecureAttempt`) stage by stage — each stage with its own
deadline, closed as soon as no connected client owes a reply — and gets back only the
weighted mean over the survivors. That mean is the aggregate of the strategy's round: it
is handed, as the round's one update, to the strategy's own ``aggregate_fit``
(`fedloom.strategies.aggregate_secure_mean`, which the local engine shares), so FedAvg,
FedAvgM, FedProx and the FedOpt family apply their ServerOptimizer to it as usual;
strategies that need the individual updates are refused when the server is built, and a
norm bound becomes clipping on the client.

Each attempt's setup binds the participants and their identities, the parameters, and
the digests of the global model and the fit config (`fedloom.secagg.RoundSetup`). With
mutual TLS the attempt is *authenticated*: clients sign their keys and the survivor set
with their certificates and check each other against the client CA (the server checks
too, so that one client's bad signature is refused here rather than sinking its honest
neighbours), and a consistency stage runs before unmask. Without it, secure rounds run
only with ``allow_unauthenticated`` (warned at start): secure against an
honest-but-curious server only; such attempts may use key offers (each client's
share-keys reply offers keys for its next attempt, kept here per connected client and
handed to one attempt, so a steady round skips advertise keys).

Dropouts cost an attempt, not the round: a client that leaves, stops its heartbeats, or
whose task stream breaks is removed at once (`client_gone`); an attempt that cannot finish
(too few clients left, a participant that did not advertise in an authenticated
attempt, a survivor that vanished before confirming, a dealer whose shares do not
reconstruct) is followed by a new attempt — a new attempt id, fresh keys, without the
clients that failed it (and without a culprit, which also gets a strike) — while the
round's ``round_timeout_s`` lasts, up to ``max_attempts``. Only then does the round
fail: committed as failed, the global model unchanged. Attempt ids are microseconds of
the wall clock, strictly increasing in a process, so a round run again after a server
restart never reuses one.

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
from typing import Any

from fedloom.errors import AggregationError, ConfigError, RejectReason, SecureAggregationError
from fedloom.messages import Capability
from fedloom.payload import PayloadInfo
from fedloom.privacy._distributed import (
    announces_distributed_dp,
    masked_length,
    round_secagg,
)
from fedloom.secagg import (
    KeyOffer,
    PeerVerifier,
    RoundId,
    RoundSetup,
    SecAggConfig,
    SecAggResult,
    Stage,
    config_digest,
    model_digest,
)
from fedloom.server.crashpoints import crashpoint
from fedloom.server.driver import FitOutcome, RoundDriver, RoundParts
from fedloom.server.metrics import ServerMetrics
from fedloom.server.secure.attempt import SecureAttempt, stage_deadline_s
from fedloom.strategies import Strategy, aggregate_secure_mean
from fedloom.types import AggregateResult, ClientInfo
from fedloom.weights import Weights

log = logging.getLogger("fedloom.server")

__all__ = ["SecureRounds"]

#: Rounds a client that refused to confirm a survivor set sits out (`SecureRounds._bench`).
BENCH_ROUNDS = 5

class SecureRounds(RoundDriver):
    """The round driver of secure (SecAgg+) fit rounds: one or more attempts a round."""

    def __init__(self, parts: RoundParts) -> None:
        super().__init__(parts)
        config = parts.config
        self.config = config
        self.secagg = config.secure_aggregation
        self.run_id = parts.run_id
        self.registry = parts.fleet.registry
        self._executor = parts.executor
        self._spool_dir = parts.spool_dir
        #: Clients sign their keys and confirmations (mutual TLS: a client PKI).
        self.authenticated = config.mutual_tls
        self._verifier: PeerVerifier | None = None
        if self.authenticated:
            try:
                self._verifier = PeerVerifier.from_pem_file(config.tls.client_ca)
            except SecureAggregationError as exc:
                raise ConfigError("tls.client_ca", str(exc)) from exc
        else:
            log.warning(
                "SECURE AGGREGATION WITHOUT A CLIENT PKI (allow_unauthenticated): clients "
                "cannot check each other's keys, so the protocol protects their updates "
                "from an honest-but-curious server only, not from one that deviates from "
                "it; serve mutual TLS (tls.client_ca) for the full protection")
        default_attempts = SecAggConfig().max_attempts
        if self.secagg.max_attempts > default_attempts:
            log.warning(
                "secure_aggregation.max_attempts is %d, but SDK clients take part in at most "
                "%d attempts of a round unless told otherwise: attempts past that run without "
                "them; set their secagg_max_attempts (fedloom client --secagg-max-attempts "
                "%d) to match", self.secagg.max_attempts, default_attempts,
                self.secagg.max_attempts)
        # The final unmasking runs over ranges of the vector in parallel (threads are
        # made when first needed).
        self._unmask_pool = concurrent.futures.ThreadPoolExecutor(
            min(4, os.cpu_count() or 1), thread_name_prefix="unmask")
        self._attempt: SecureAttempt | None = None
        self._last_attempt = 0
        self._offers: dict[str, KeyOffer] = {}  # client id -> its unused key offer
        #: What the server learned in the last secure round that succeeded (sums only).
        self.last_result: SecAggResult | None = None
        #: The public parameters of the last attempt (its round id, participants, ...).
        self.last_setup: RoundSetup | None = None
        #: Wall seconds of each stage of the last attempt (also in the round's record).
        self.last_stage_s: dict[str, float] = {}
        # identity (or session id) -> the last round it sits out (`BENCH_ROUNDS`)
        self._benched: dict[str, int] = {}

    @property
    def running(self) -> tuple[int, Stage] | None:
        """(round, stage) of the attempt in progress, or None (safe from any thread)."""
        attempt = self._attempt
        return None if attempt is None else (attempt.setup.round_id.server_round,
                                             attempt.machine.stage)

    def client_gone(self, client_id: str, reason: str) -> None:
        """A client is gone (left, silent, its stream broke): out of the attempt in
        progress at once, and its key offer with it."""
        self._offers.pop(client_id, None)
        if self._attempt is not None:
            self._attempt.drop(client_id, reason)

    def close(self) -> None:
        self._unmask_pool.shutdown(wait=False)

    # -- one round ----------------------------------------------------------------------
    def _next_attempt(self) -> int:
        self._last_attempt = max(self._last_attempt + 1, time.time_ns() // 1000)
        return self._last_attempt

    async def run_fit(self, server_round: int) -> FitOutcome:
        """Run one secure fit round (one or more attempts)."""
        parts = self.parts
        parts.reporter.round_started(server_round, self.config.num_rounds,
                                     self.config.min_fit_clients)
        eligible = await parts.fleet.wait_for(self.config.min_fit_clients, Capability.SECAGG)
        eligible = [c for c in eligible if self._benched.get(self._who(c.client_id), 0)
                    < server_round]
        current, payload, payload_info = parts.model.weights, parts.model.payload, parts.model.info
        try:
            outcome = await self._run_round(server_round, current, eligible, payload,
                                            payload_info)
        finally:
            self.clean_spool()
        return outcome

    async def _run_round(self, server_round: int, current: Weights, eligible: list[ClientInfo],
                         payload: memoryview, payload_info: PayloadInfo
                         ) -> FitOutcome:
        strategy = self.parts.strategy
        plan = strategy.configure_fit(server_round, current, eligible)
        participants = [c for c in plan.client_ids if c in self.registry]
        participants = participants[: self.secagg.max_participants]
        info: dict[str, Any] = {}
        record = FitOutcome(None, num_sampled=len(participants),
                            num_failures=len(participants), secure_aggregation=info)
        deadline = time.monotonic() + self.config.round_timeout_s
        binding = {"model_digest": model_digest(current.specs(), payload_info.sha256),
                   "config_digest": config_digest(plan.config)}
        failures: list[str] = []
        outcome: SecAggResult | str = "no attempt was made"
        for number in range(1, self.secagg.max_attempts + 1):
            try:
                setup = self._setup(server_round, participants, current, binding, plan.config)
            except ConfigError as exc:
                outcome = f"the round cannot start: {exc}"
                break
            outcome, excluded = await self._run_attempt(setup, payload, payload_info,
                                                        plan.config)
            info.update(attempt=setup.round_id.attempt, attempts=number,
                        stage_s={k: round(v, 4) for k, v in self.last_stage_s.items()})
            if not isinstance(outcome, str):
                break
            failures.append(outcome)
            participants = [c for c in participants if c not in excluded and c in self.registry]
            if (number == self.secagg.max_attempts or time.monotonic() >= deadline
                    or len(participants) < self.secagg.survivor_floor):
                break
            log.warning("secure round %d attempt %d failed: %s; retrying with %d clients",
                        server_round, number, outcome, len(participants))
        if failures:
            info["failures"] = failures
        if isinstance(outcome, str):  # logged with the round's commit, as its reason
            info["failure"] = outcome
            said = outcome if outcome.startswith("secure aggregation") else (
                f"secure aggregation: {outcome}")
            record.result = AggregateResult(None, reason=said)
            return record
        self.last_result = outcome
        survivors = len(outcome.survivors)
        record.num_updates, record.num_failures = survivors, record.num_sampled - survivors
        dropped = len(outcome.dropped)
        # participants of the attempt in neither set: they vanished before sharing their
        # keys, so are out of the sum, but still cost the neighbours their shares
        left_out = (len(self.last_setup.participants) - survivors - dropped
                    if self.last_setup is not None else 0)
        info.update(survivors=survivors, dropped=dropped, left_out=left_out,
                    total_examples=round(outcome.total_examples))
        try:
            record.result = await self._apply(strategy, server_round, current, outcome)
        except (AggregationError, SecureAggregationError) as exc:
            # e.g. a distributed-DP sum whose contributor count does not match: the round
            # fails and is committed as failed (with the strategy's state: its ledger
            # has this unmasked sum); the server carries on
            record.result = AggregateResult.failed(exc, survivors)
            info["failure"] = record.result.reason
        return record

    def _setup(self, server_round: int, participants: list[str], current: Weights,
               binding: dict[str, bytes], fit_config: Any) -> RoundSetup:
        identities = {}
        for cid in participants:
            client = self.registry.get(cid)
            if client is not None:
                identities[cid] = client.info.name
        setup = RoundSetup.create(
            round_secagg(self.secagg, fit_config),
            RoundId(self.run_id, server_round, self._next_attempt()), sorted(identities),
            masked_length(fit_config, sum(spec.size for spec in current.specs())),
            identities=identities, authenticated=self.authenticated, **binding)
        self.last_setup = setup
        return setup

    async def _run_attempt(self, setup: RoundSetup, payload: memoryview,
                           payload_info: PayloadInfo, fit_config: Any
                           ) -> tuple[SecAggResult | str, set[str]]:
        """Run the stages of one attempt; its result (or why it failed) and the clients
        a retry leaves out."""
        offers: dict[str, KeyOffer] = {}
        if not setup.authenticated:  # keys offered ahead of a setup: unauthenticated only
            self._offers = {c: o for c, o in self._offers.items() if c in self.registry}
            offers = {c: self._offers.pop(c) for c in setup.participants if c in self._offers}
        attempt = SecureAttempt(setup, self.config, payload, payload_info, fit_config,
                                self._executor, self.parts.book, self._spool_dir,
                                self._unmask_pool.map, offers, self._verifier)
        self._attempt = attempt
        self.last_stage_s = {}
        try:
            started = time.monotonic()
            stage: Stage | None = await attempt.open_stage()
            while stage is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(stage_deadline_s(self.config, stage)):
                        await attempt.complete.wait()
                answered, issued = attempt.counts()
                attempt.close_stage()
                following = await attempt.advance()  # the last one unmasks
                self.last_stage_s[str(stage)] = time.monotonic() - started
                crashpoint("mid_secure_aggregation")  # recovery tests: a kill between stages
                log.info("secure round %d: %s closed after %.2f s (%d/%d answered)",
                         setup.round_id.server_round, stage, time.monotonic() - started,
                         answered, issued)
                stage, started = following, time.monotonic()
            return attempt.machine.result, set()
        except SecureAggregationError as exc:
            machine = attempt.machine
            for culprit in sorted(machine.culprits):
                log.warning("secure round %d: client %s dealt shares that do not reconstruct "
                            "its committed secret", setup.round_id.server_round, culprit)
                self.parts.fleet.strike_id(culprit, RejectReason.INVALID)
            excluded = machine.failed_clients | machine.culprits | machine.revealed
            excluded |= attempt.accused  # named neighbours: participants
            self._bench(attempt.withheld, setup.round_id.server_round)
            if announces_distributed_dp(fit_config):  # they count a confirmation as taking
                excluded |= machine.confirmed        # part (fedloom.secagg._client)
            return str(exc), excluded
        finally:
            attempt.close_stage(end=True)  # the book keeps how its tasks ended
            ServerMetrics.tasks_closed("fit", attempt.fit_outcomes())
            self._offers.update(attempt.machine.new_offers)  # unused: for a later attempt
            self._attempt = None

    def _who(self, client_id: str) -> str:
        record = self.registry.get(client_id)
        return (record.identity or client_id) if record is not None else client_id

    def _bench(self, clients: set[str], server_round: int) -> None:
        """Survivors that refused to confirm the survivor set: an honest server's set is
        one every honest client confirms, so each refusal fails the attempt on purpose
        (in a distributed-DP round, the whole round). Each gets a strike and sits out
        the next `BENCH_ROUNDS` rounds, so it cannot fail round after round."""
        for client_id in sorted(clients):
            log.warning("secure round %d: client %s refused to confirm the survivor set; it "
                        "sits out %d rounds", server_round, client_id, BENCH_ROUNDS)
            self._benched[self._who(client_id)] = server_round + BENCH_ROUNDS
            self.parts.fleet.strike_id(client_id, RejectReason.INVALID)

    async def _apply(self, strategy: Strategy, server_round: int, current: Weights,
                     outcome: SecAggResult) -> AggregateResult:
        """The strategy's step with the secure mean (`aggregate_secure_mean`), off the loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, aggregate_secure_mean, strategy,
                                          server_round, current, outcome)

