"""Secure aggregation (SecAgg+) in the local engine: the real state machines, in-process.

`LocalSecureAggregation` runs each fit round of `fedloom.simulations.local_engine.run_local`
as a SecAgg+ round (Bell et al., CCS 2020, over Bonawitz et al., CCS 2017), driving the
same pure state machines a deployment runs: one `fedloom.secagg.SecAggServer` per round
and one `fedloom.secagg.SecAggClient` per sampled client. Nothing is
simplified: keys are agreed, shares sealed and opened, inputs clipped, weighted,
quantized and masked, and the server unmasks the sum; only the transport is gone.

What each client does is what `fedloom.client_sdk.secure_fit.SecureFit` does over gRPC:
it trains (the engine's ordinary fit, with the same config and seed as a plain round),
takes the delta, clips it to ``max_update_norm`` when the fit config holds one
(`clip_delta`), refuses ``num_examples > max_weight``, and hands the flat delta to its
`SecAggClient`. (Here every client trains before the stages start; over gRPC a client
trains in the masked-input stage, so one whose training fails drops out after sharing
its keys and its masks are removed, where here it never joins stage 1. The mean is the
same.) The server side is `SecAggServer` plus `aggregate_secure_mean`, the very
function the gRPC rounds call, so the secure mean meets the strategy (FedAvg, FedAvgM,
FedProx, the FedOpt family) exactly as in deployment. The result equals the plain
run's weighted mean within the quantization bound (`tests/simulations/test_sim_secagg.py`).

Dropouts (`SecureDropout`, from `fedloom.simulations.secure_dropout`): a chosen share
of the participants answer a stage and then vanish; the server drops them, and the
round finishes over the survivors (their masks removed with the shares the survivors
reveal) or fails cleanly as a deployed one would.

Example::

    from fedloom.secagg import SecAggConfig
    from fedloom.simulations.local_secure import LocalSecureAggregation, SecureDropout

    secure = LocalSecureAggregation(
        SecAggConfig(enabled=True, neighbours=6, threshold=4, max_weight=500.0),
        SecureDropout(fraction=0.2, after="share_keys"))
    history = run_local(FedAvg(seed=0), make_client, initial, num_clients=20,
                        num_rounds=5, secure_aggregation=secure)
    secure.reports[-1].survivors, secure.reports[-1].stage_s

Determinism: keys are fresh random bytes every round, but the masks cancel exactly, and
each client's stochastic rounding is seeded from (``seed``, round, client id): a run is
reproducible, weight for weight.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from fedloom.errors import ConfigError, MessageRejectedError, SecureAggregationError
from fedloom.secagg import (
    AdvertisedKeys,
    AdvertiseKeysRequest,
    EncryptedShare,
    MaskedInputReply,
    MaskedInputRequest,
    RoundId,
    RoundSetup,
    SecAggClient,
    SecAggConfig,
    SecAggReply,
    SecAggRequest,
    SecAggServer,
    SecAggStatus,
    ShareKeysReply,
    ShareKeysRequest,
    Stage,
    UnmaskReply,
    UnmaskRequest,
    clip_delta,
    flatten,
    neighbour_graph,
    ring_order,
)
from fedloom.simulations.secure_dropout import SecureDropout
from fedloom.strategies import Strategy, aggregate_secure_mean, check_secure_strategy
from fedloom.types import MAX_NORM_KEY, AggregateResult, ClientUpdate, FitPlan
from fedloom.weights import Weights

logger = logging.getLogger(__name__)

#: ``map``, or a thread pool's ``map``.
MapFn = Callable[..., Iterable[Any]]
#: Below this many parameters a masked input is too little work to share among threads
#: (measured: threads slowed 100k-parameter rounds by a quarter, sped 1M ones by a fifth).
PARALLEL_LENGTH = 1 << 18

__all__ = ["LocalSecureAggregation", "SecureDropout", "SecureRoundReport", "payload_bytes",
           "spread_dropouts"]

@dataclasses.dataclass
class SecureRoundReport:
    """What one simulated secure round did and cost (`LocalSecureAggregation.reports`).

    ``stage_s`` is the wall time of each stage (every client's work and the server's);
    ``client_cpu_s`` the CPU seconds summed over the clients per stage, ``"train"``
    included; ``bytes_sent`` each client's upload as the payload of its replies (ids,
    keys, sealed shares, the uint32 masked vector, revealed shares; no envelope).
    """

    server_round: int
    attempt: int
    participants: tuple[str, ...] = ()
    survivors: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    vanished: tuple[str, ...] = ()
    failure: str = ""
    stage_s: dict[str, float] = dataclasses.field(default_factory=dict)
    client_cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)
    bytes_sent: dict[str, int] = dataclasses.field(default_factory=dict)


def payload_bytes(message: Any) -> int:
    """Bytes of a SecAgg+ message's payload fields (ids as UTF-8; no envelope)."""
    if isinstance(message, AdvertiseKeysRequest):
        return sum(len(p) for p in message.setup.participants) + 32 + 8 * 8
    if isinstance(message, AdvertisedKeys):
        return len(message.client_id) + 96
    if isinstance(message, ShareKeysRequest):
        return sum(len(k.client_id) + 96 for k in message.neighbours)
    if isinstance(message, EncryptedShare):
        return len(message.sender) + len(message.receiver) + 12 + len(message.ciphertext)
    if isinstance(message, ShareKeysReply | MaskedInputRequest):
        return sum(payload_bytes(s) for s in message.shares)
    if isinstance(message, MaskedInputReply):
        return len(message.client_id) + message.masked.nbytes
    if isinstance(message, UnmaskRequest):
        return sum(len(c) for c in (*message.survivors, *message.dropped))
    if isinstance(message, UnmaskReply):
        return sum(len(s.owner) + len(s.value)
                   for s in (*message.self_mask_shares, *message.mask_key_shares))
    raise TypeError(f"not a SecAgg+ message: {type(message).__name__}")


def spread_dropouts(setup: RoundSetup, candidates: Iterable[str], count: int) -> frozenset[str]:
    """Up to ``count`` of ``candidates`` to vanish such that every candidate keeps at
    least ``threshold`` neighbours among those that stay (so the round can finish).

    Greedy over the ring order, every ``len / count``-th client first; deterministic
    for a given setup, so any party (e.g. a benchmark's client processes) can compute
    the same set.
    """
    graph = neighbour_graph(setup)
    pool = set(candidates)
    ring = [c for c in ring_order(setup.participants, setup.graph_seed) if c in pool]
    if count <= 0 or not ring:
        return frozenset()
    stride = max(1, len(ring) // count)
    order = ring[::stride] + [c for i, c in enumerate(ring) if i % stride]
    staying = {u: len(graph[u] & pool) for u in ring}  # neighbours that stay, per client
    chosen: set[str] = set()
    t = setup.threshold
    for u in order:
        if len(chosen) == count:
            break
        if staying[u] < t or any(staying[v] <= t for v in graph[u] & pool):
            continue
        chosen.add(u)
        for v in graph[u] & pool:
            staying[v] -= 1
    return frozenset(chosen)


class LocalSecureAggregation:
    """Runs the local engine's fit rounds under SecAgg+ (see the module docstring).

    Args:
        config: the ``[secure_aggregation]`` settings (k, t, clip range, bits, ...).
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
        self.reports: list[SecureRoundReport] = []
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
        """Train the plan's clients (``updates``), run one SecAgg+ round over them, and
        give the secure mean to ``strategy``. Clients whose input is not in the sum are
        appended to ``failures``."""
        self.check(strategy)
        self._attempt += 1
        report = SecureRoundReport(server_round, self._attempt)
        self.reports.append(report)
        inputs = self._train(plan, updates, failures, report)
        participants = tuple(c for c in plan.client_ids if c not in set(failures))
        try:
            setup = RoundSetup.create(
                self.config, RoundId(self.run_id, server_round, self._attempt),
                plan.client_ids, sum(spec.size for spec in current.specs()))
        except ConfigError as exc:
            return self._failed(report, f"the round cannot start: {exc}", plan, failures)
        report.participants = setup.participants
        with contextlib.ExitStack() as stack:
            map_fn: MapFn = map  # lazy: one client at a time
            if self.workers > 1 and setup.vector_length >= PARALLEL_LENGTH:
                map_fn = stack.enter_context(
                    concurrent.futures.ThreadPoolExecutor(self.workers)).map
            server = SecAggServer(setup, map_fn=map_fn)
            for cid in set(setup.participants) - set(participants):
                server.drop(cid)  # failed to train: never answers stage 1
            # new clients every round, so no key offers (they could never be used)
            clients = {cid: SecAggClient(cid, rng=self._rounding_rng(server_round, cid),
                                         offer_keys=False)
                       for cid in participants}
            vanishing = self._vanishing(setup, server_round, participants)
            report.vanished = tuple(sorted(vanishing))
            try:
                while server.status is SecAggStatus.RUNNING:
                    self._run_stage(server, clients, inputs, vanishing, report, map_fn)
            except SecureAggregationError as exc:
                return self._failed(report, str(exc), plan, failures)
        outcome = server.result
        report.survivors, report.dropped = outcome.survivors, outcome.dropped
        gone = set(setup.participants) - set(outcome.survivors) - set(failures)
        failures.extend(sorted(gone))
        result = aggregate_secure_mean(strategy, server_round, current, outcome)
        metrics = {**result.metrics, "secagg_dropped": len(outcome.dropped)}
        return dataclasses.replace(result, metrics=metrics)

    def _train(self, plan: FitPlan, updates: Iterable[ClientUpdate], failures: list[str],
               report: SecureRoundReport) -> dict[str, tuple[Weights, int]]:
        """Each client's (delta, num_examples), clipped to the norm bound; a client that
        fails to train or claims more than ``max_weight`` is a failure (as over gRPC)."""
        bound = plan.config.get(MAX_NORM_KEY)
        inputs: dict[str, tuple[Weights, int]] = {}
        iterator: Iterator[ClientUpdate] = iter(updates)
        while True:
            started = time.thread_time()
            update = next(iterator, None)
            self._add(report.client_cpu_s, "train", time.thread_time() - started)
            if update is None:
                return inputs
            try:
                self.config.weight_of(update.num_examples)
            except SecureAggregationError as exc:
                logger.warning("client %s refuses the secure round: %s", update.client_id, exc)
                failures.append(update.client_id)
                continue
            delta = update.delta
            if isinstance(bound, int | float) and not isinstance(bound, bool):
                delta = clip_delta(delta, float(bound))
            inputs[update.client_id] = (delta, update.num_examples)

    def _run_stage(self, server: SecAggServer, clients: dict[str, SecAggClient],
                   inputs: dict[str, tuple[Weights, int]], vanishing: frozenset[str],
                   report: SecureRoundReport, map_fn: MapFn) -> None:
        """Every pending client answers the open stage (``map_fn`` may compute the
        masked inputs in parallel); the server takes them in order, then closes it."""
        stage, started = server.stage, time.perf_counter()
        if stage is not Stage.MASKED_INPUT:
            map_fn = map  # little work per client, in Python: threads only contend
        order = list(Stage)
        vanish_now = order.index(stage) == order.index(self.dropout.stage) + 1
        asked: list[tuple[str, SecAggRequest]] = []
        for cid in sorted(server.pending()):
            if vanish_now and cid in vanishing:
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
                delta, num_examples = inputs.pop(cid)
                reply = clients[cid].handle(request, vector=flatten(delta, dtype=None),
                                            num_examples=num_examples)
            except SecureAggregationError as exc:  # a refusal is a dropout
                logger.warning("secure round: %s", exc)
                return cid, None, None
            finally:
                with self._lock:
                    self._add(report.client_cpu_s, str(stage), time.thread_time() - cpu)
            # the transport's digest of the upload (the server recognises retries by it)
            assert isinstance(reply, MaskedInputReply)
            return cid, reply, hashlib.sha256(reply.masked.data.cast("B")).digest()

        for cid, reply, digest in map_fn(answer, asked):
            if reply is None:
                server.drop(cid)
                continue
            report.bytes_sent[cid] = report.bytes_sent.get(cid, 0) + payload_bytes(reply)
            try:
                server.receive(cid, reply, digest=digest)
            except MessageRejectedError as exc:
                logger.warning("secure round: the reply of %s was refused: %s", cid, exc)
                server.drop(cid)
                continue
            if stage is Stage.UNMASK and server.can_finish():
                break  # as over gRPC: the stage closes once every secret has t shares
        server.advance()
        self._add(report.stage_s, str(stage), time.perf_counter() - started)

    # -- helpers --------------------------------------------------------------------
    def _vanishing(self, setup: RoundSetup, server_round: int,
                   participants: tuple[str, ...]) -> frozenset[str]:
        drop = self.dropout
        if not drop.applies_to(server_round):
            return frozenset()
        count = round(drop.fraction * len(participants))
        if drop.choice == "spread":
            return spread_dropouts(setup, participants, count)
        rng = np.random.default_rng([drop.seed, server_round])
        return frozenset(str(c) for c in rng.choice(sorted(participants), count, replace=False))

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
