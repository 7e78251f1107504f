"""Secure aggregation (SecAgg+) in the local engine: the real state machines, in-process.

`LocalSecureAggregation` runs each fit round of `fedloom.simulations.local_engine.run_local`
as a SecAgg+ round (Bell et al., CCS 2020, over Bonawitz et al., CCS 2017), driving the
same pure state machines a deployment runs: one `fedloom.secagg.SecAggServer` per attempt
and one `fedloom.secagg.SecAggClient` per sampled client. Nothing is simplified: keys are
agreed (and, by default, signed with certificates of a throwaway client CA made for the
run, checked by every client), shares sealed, committed to and opened, inputs clipped,
weighted, quantized and masked, the survivor set confirmed, and the server unmasks the
sum; only the transport is gone. ``allow_unauthenticated = true`` in the configuration
runs the unauthenticated variant (no certificates, no consistency stage).

What each client does is what `fedloom.client_sdk.secure_fit.SecureFit` does over gRPC:
it trains (the engine's ordinary fit, with the same config and seed as a plain round),
takes the delta, clips it to ``max_update_norm`` when the fit config holds one
(`clip_delta`), refuses ``num_examples > max_weight``, and hands the flat delta to its
`SecAggClient`. (Here every client trains before the stages start; over gRPC a client
trains in the masked-input stage, so one whose training fails drops out after sharing
its keys and its masks are removed, where here it never joins. The mean is the same.)
The server side is `SecAggServer` plus `fedloom.strategies.aggregate_secure_mean`, the
very function the gRPC rounds call, so the secure mean meets the strategy (FedAvg,
FedAvgM, FedProx, the FedOpt family) exactly as in deployment. The result equals the
plain run's weighted mean within the quantization bound
(`tests/simulations/test_sim_secagg.py`).

Dropouts (`SecureDropout`, from `fedloom.simulations.secure_dropout`): a chosen share
of the participants answer a stage and then vanish; the server drops them, and the
round finishes over the survivors (their masks removed with the shares the survivors
reveal). An attempt that cannot finish is retried, as the server does, with fresh keys
and without the clients that failed it, up to ``max_attempts``; only then does the round
fail (the model is kept).

Example::

    from fedloom.secagg import SecAggConfig
    from fedloom.simulations.local_secure import LocalSecureAggregation, SecureDropout

    secure = LocalSecureAggregation(
        SecAggConfig(enabled=True, neighbours=6, threshold=4, max_weight=500.0),
        SecureDropout(fraction=0.2, after="share_keys"))
    history = run_local(FedAvg(), make_client, initial, num_clients=20,
                        num_rounds=5, secure_aggregation=secure)
    secure.reports[-1].survivors, secure.reports[-1].stage_s

Determinism: keys are fresh random bytes every attempt, but the masks cancel exactly,
and each client's stochastic rounding is seeded from (``seed``, round, client id): a run
is reproducible, weight for weight.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from fedloom import certs
from fedloom.errors import ConfigError, MessageRejectedError, SecureAggregationError
from fedloom.fit_config import MAX_UPDATE_NORM
from fedloom.payload import digest, serialize
from fedloom.privacy._distributed import (
    announces_distributed_dp,
    encode_for_secagg,
    from_fit_config,
    masked_length,
    round_secagg,
)
from fedloom.secagg import (
    MaskedInputReply,
    PeerVerifier,
    RoundId,
    RoundSetup,
    SecAggClient,
    SecAggConfig,
    SecAggReply,
    SecAggRequest,
    SecAggResult,
    SecAggServer,
    SecAggStatus,
    SigningIdentity,
    Stage,
    clip_delta,
    config_digest,
    flatten,
    model_digest,
)
from fedloom.simulations.secure_dropout import SecureDropout, spread_dropouts
from fedloom.simulations.secure_report import SecureRoundReport, payload_bytes
from fedloom.strategies import Strategy, aggregate_secure_mean, check_secure_strategy
from fedloom.types import AggregateResult, ClientUpdate, FitPlan
from fedloom.weights import Weights

logger = logging.getLogger(__name__)

#: ``map``, or a thread pool's ``map``.
MapFn = Callable[..., Iterable[Any]]
#: Below this many parameters a masked input is too little work to share among threads
#: (measured: threads slowed 100k-parameter rounds by a quarter, sped 1M ones by a fifth).
PARALLEL_LENGTH = 1 << 18

__all__ = ["LocalSecureAggregation", "SecureDropout", "SecureRoundReport", "payload_bytes",
           "spread_dropouts"]


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")


class _LocalPki:
    """A throwaway client CA and one certificate per simulated client (made once)."""

    def __init__(self) -> None:
        self._ca = certs.make_ca("fedloom simulation client CA")
        self.verifier = PeerVerifier([self._ca.cert])
        self._identities: dict[str, SigningIdentity] = {}

    @staticmethod
    def name(client_id: str) -> str:
        if _NAME.fullmatch(client_id):
            return client_id
        return "sim-" + hashlib.sha256(client_id.encode()).hexdigest()[:16]

    def identity(self, client_id: str) -> SigningIdentity:
        if client_id not in self._identities:
            issued = certs.make_client_cert(self._ca, self.name(client_id))
            self._identities[client_id] = SigningIdentity(issued.cert, issued.key)
        return self._identities[client_id]


class LocalSecureAggregation:
    """Runs the local engine's fit rounds under SecAgg+ (see the module docstring).

    Args:
        config: the ``[secure_aggregation]`` settings (k, t, clip range, bits, ...);
            ``allow_unauthenticated`` runs unauthenticated attempts (no client PKI).
        dropout: clients that vanish mid-protocol (none by default).
        run_id: the run id bound into every key derivation and share.
        seed: seeds each client's stochastic rounding (per round and client id).
        workers: threads that compute the clients' masked inputs, and the server's
            unmasking, in parallel for models of at least `PARALLEL_LENGTH` parameters
            (OpenSSL and numpy release the GIL; training and the other stages stay one
            client at a time). The result does not depend on it: each client's
            rounding has its own generator, and the server takes replies in order.
    """

    def __init__(self, config: SecAggConfig, dropout: SecureDropout | None = None, *,
                 run_id: str = "local", seed: int = 0,
                 workers: int = min(4, os.cpu_count() or 1)) -> None:
        if not config.enabled:
            raise ConfigError("secure_aggregation.enabled",
                              "is false; pass no secure aggregation to run plain rounds")
        self.config = config
        self.dropout = dropout or SecureDropout()
        self.run_id = run_id
        self.seed = seed
        self.workers = max(1, workers)
        self.authenticated = not config.allow_unauthenticated
        self.reports: list[SecureRoundReport] = []
        self._pki = _LocalPki() if self.authenticated else None
        self._attempt = 0
        self._lock = threading.Lock()  # the reports' CPU totals, from worker threads

    def check(self, strategy: Strategy) -> None:
        """Refuse a strategy that needs individual updates (as the server does)."""
        check_secure_strategy(strategy, self.config)

    def limit(self, plan: FitPlan) -> FitPlan:
        """The plan cut to ``max_participants`` clients (as the server cuts a sample)."""
        cap = self.config.max_participants
        return plan if len(plan.client_ids) <= cap else dataclasses.replace(
            plan, client_ids=plan.client_ids[:cap])

    # -- one round ------------------------------------------------------------------
    def aggregate_fit(self, strategy: Strategy, server_round: int, current: Weights,
                      plan: FitPlan, updates: Iterable[ClientUpdate],
                      failures: list[str]) -> AggregateResult:
        """Train the plan's clients (``updates``), run SecAgg+ over them (retrying a
        failed attempt as the server does), and give the secure mean to ``strategy``.
        Clients whose input is not in the sum are appended to ``failures``."""
        self.check(strategy)
        report = SecureRoundReport(server_round, self._attempt)
        self.reports.append(report)
        inputs = self._train(plan, updates, failures, report)
        participants = [c for c in plan.client_ids if c in inputs]
        binding = {"model_digest": model_digest(current.specs(), digest(serialize(current))),
                   "config_digest": config_digest(plan.config)}
        outcome: SecAggResult | str = "no client trained"
        while report.attempts < self.config.max_attempts:
            self._attempt += 1
            report.attempt, report.attempts = self._attempt, report.attempts + 1
            try:
                setup = RoundSetup.create(
                    round_secagg(self.config, plan.config),
                    RoundId(self.run_id, server_round, self._attempt), participants,
                    masked_length(plan.config, sum(spec.size for spec in current.specs())),
                    identities={c: _LocalPki.name(c) for c in participants},
                    authenticated=self.authenticated, **binding)
            except ConfigError as exc:
                outcome = f"the round cannot start: {exc}"
                break
            report.participants = setup.participants
            outcome, failed = self._run_attempt(setup, server_round, inputs, report,
                                                announces_distributed_dp(plan.config))
            if not isinstance(outcome, str):
                break
            report.failures.append(outcome)
            participants = [c for c in participants if c not in failed]
            if len(participants) < self.config.survivor_floor:
                break
        if isinstance(outcome, str):
            return self._failed(report, outcome, plan, failures)
        report.survivors, report.dropped = outcome.survivors, outcome.dropped
        gone = set(plan.client_ids) - set(outcome.survivors) - set(failures)
        failures.extend(sorted(gone))
        result = aggregate_secure_mean(strategy, server_round, current, outcome)
        metrics = {**result.metrics, "secagg_dropped": len(outcome.dropped)}
        return dataclasses.replace(result, metrics=metrics)

    def _run_attempt(self, setup: RoundSetup, server_round: int,
                     inputs: dict[str, tuple[Weights | np.ndarray, int]],
                     report: SecureRoundReport, private: bool = False
                     ) -> tuple[SecAggResult | str, set[str]]:
        """One attempt; its result (or why it failed) and the clients a retry leaves out
        (as the server: in a distributed-DP round, also those that confirmed)."""
        with contextlib.ExitStack() as stack:
            map_fn: MapFn = map  # lazy: one client at a time
            if self.workers > 1 and setup.vector_length >= PARALLEL_LENGTH:
                map_fn = stack.enter_context(
                    concurrent.futures.ThreadPoolExecutor(self.workers)).map
            pki = self._pki
            server = SecAggServer(setup, map_fn=map_fn,
                                  verifier=pki.verifier if pki is not None else None)
            # new clients every attempt, so no key offers (they could never be used)
            clients = {cid: self._client(cid, server_round, pki) for cid in setup.participants}
            first = report.attempts == 1  # dropouts strike the round's first attempt
            previous: Stage | None = None
            vanishing: frozenset[str] = frozenset()
            try:
                while server.status is SecAggStatus.RUNNING:
                    if first and previous is not None and str(previous) == self.dropout.after:
                        vanishing = self._vanishing(server, server_round)
                        report.vanished = tuple(sorted(vanishing))
                    previous = server.stage
                    self._run_stage(server, clients, inputs, vanishing, report, map_fn)
                    vanishing = frozenset()  # they are gone; nothing more to drop
            except SecureAggregationError as exc:
                excluded = server.failed_clients | server.culprits | server.revealed
                return str(exc), (excluded | server.confirmed) if private else excluded
            return server.result, set()

    def _client(self, client_id: str, server_round: int, pki: _LocalPki | None
                ) -> SecAggClient:
        rng = self._rounding_rng(server_round, client_id)
        if pki is None:
            return SecAggClient(client_id, rng=rng, offer_keys=False)
        return SecAggClient(client_id, identity=pki.identity(client_id), peers=pki.verifier,
                            rng=rng)

    def _train(self, plan: FitPlan, updates: Iterable[ClientUpdate], failures: list[str],
               report: SecureRoundReport) -> dict[str, tuple[Weights | np.ndarray, int]]:
        """Each client's (delta, num_examples), clipped to the norm bound; a client that
        fails to train or claims more than ``max_weight`` is a failure (as over gRPC)."""
        bound = plan.config.get(MAX_UPDATE_NORM)
        inputs: dict[str, tuple[Weights | np.ndarray, int]] = {}
        iterator: Iterator[ClientUpdate] = iter(updates)
        while True:
            started = time.thread_time()
            update = next(iterator, None)
            self._add(report.client_cpu_s, "train", time.thread_time() - started)
            if update is None:
                return inputs
            delta = update.delta
            size = sum(spec.size for spec in delta.specs())
            private = from_fit_config(plan.config, size)
            if private is not None:  # distributed DP: the client's encoding, noise included
                # seeded like the rounding, so a simulated run is reproducible
                rng = self._rounding_rng(report.server_round, update.client_id)
                vector = encode_for_secagg(flatten(delta, dtype=None), *private, rng=rng)
                inputs[update.client_id] = (vector, update.num_examples)
                continue
            try:
                self.config.weight_of(update.num_examples)
            except SecureAggregationError as exc:
                logger.warning("client %s refuses the secure round: %s", update.client_id, exc)
                failures.append(update.client_id)
                continue
            if isinstance(bound, int | float) and not isinstance(bound, bool):
                delta = clip_delta(delta, float(bound))
            inputs[update.client_id] = (delta, update.num_examples)

    def _run_stage(self, server: SecAggServer, clients: dict[str, SecAggClient],
                   inputs: dict[str, tuple[Weights | np.ndarray, int]], vanishing: frozenset[str],
                   report: SecureRoundReport, map_fn: MapFn) -> None:
        """Every pending client answers the open stage (``map_fn`` may compute the
        masked inputs in parallel); the server takes them in order, then closes it."""
        stage, started = server.stage, time.perf_counter()
        if stage is not Stage.MASKED_INPUT:
            map_fn = map  # little work per client, in Python: threads only contend
        asked: list[tuple[str, SecAggRequest]] = []
        for cid in sorted(server.pending()):
            if cid in vanishing:
                server.drop(cid)  # answered the stage before, gone before this one
                continue
            asked.append((cid, server.request_for(cid)))

        def answer(item: tuple[str, SecAggRequest]
                   ) -> tuple[str, SecAggReply | None, bytes | None]:
            cid, request = item
            cpu = time.thread_time()
            try:
                if stage is not Stage.MASKED_INPUT:
                    return cid, clients[cid].handle(request), None
                delta, num_examples = inputs[cid]
                vector = delta if isinstance(delta, np.ndarray) else flatten(delta, dtype=None)
                reply = clients[cid].handle(request, vector=vector, num_examples=num_examples)
            except SecureAggregationError as exc:  # a refusal is a dropout
                logger.warning("secure round: %s", exc)
                return cid, None, None
            finally:
                with self._lock:
                    self._add(report.client_cpu_s, str(stage), time.thread_time() - cpu)
            # the transport's digest of the upload (the server recognises retries by it)
            assert isinstance(reply, MaskedInputReply)
            return cid, reply, hashlib.sha256(reply.masked.data.cast("B")).digest()

        for cid, reply, sha in map_fn(answer, asked):
            if reply is None:
                server.drop(cid)
                continue
            report.bytes_sent[cid] = report.bytes_sent.get(cid, 0) + payload_bytes(reply)
            try:
                server.receive(cid, reply, digest=sha)
            except MessageRejectedError as exc:
                logger.warning("secure round: the reply of %s was refused: %s", cid, exc)
                server.drop(cid)
                continue
            if stage is Stage.UNMASK and server.can_finish():
                break  # as over gRPC: the stage closes once every secret has t shares
        try:
            server.advance()
        finally:
            self._add(report.stage_s, str(stage), time.perf_counter() - started)

    # -- helpers --------------------------------------------------------------------
    def _vanishing(self, server: SecAggServer, server_round: int) -> frozenset[str]:
        """The clients that vanish now: they answered the stage that just closed."""
        drop = self.dropout
        candidates = sorted(server.pending())
        if not drop.applies_to(server_round) or not candidates:
            return frozenset()
        count = round(drop.fraction * len(server.setup.participants))
        if drop.choice == "spread":
            return spread_dropouts(server.graph, server.setup.threshold, candidates, count)
        rng = np.random.default_rng([drop.seed, server_round])
        return frozenset(str(c) for c in rng.choice(candidates, min(count, len(candidates)),
                                                    replace=False))

    def _rounding_rng(self, server_round: int, client_id: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, server_round, *client_id.encode()])

    @staticmethod
    def _add(totals: dict[str, float], key: str, seconds: float) -> None:
        totals[key] = totals.get(key, 0.0) + seconds

    @staticmethod
    def _failed(report: SecureRoundReport, why: str, plan: FitPlan,
                failures: list[str]) -> AggregateResult:
        logger.warning("secure round %d failed: %s; the global model is unchanged",
                       report.server_round, why)
        report.failure = why
        failures.extend(c for c in plan.client_ids if c not in set(failures))
        return AggregateResult(None, {}, reason=f"secure aggregation failed: {why}")
