"""The coordinator: runs the rounds. Knows nothing of gRPC.

Each round: wait for ``min_clients``; let the strategy sample and configure fit tasks;
hand them to the clients' mailboxes; fold verified updates into the strategy's
aggregate as they arrive (in a worker thread); close at the first of "all answered" or
the deadline (with at least ``min_fit_clients``); run federated and server-side
evaluation; commit the round (checkpoint, then SQLite). A failed round leaves the
global model unchanged and the next round starts.

The servicer calls `join`, `pull`, `accept_result`, `finish_upload`, `heartbeat` and
`leave`; each validates its input and raises `MessageRejectedError` with a reason.

Under ``[secure_aggregation] enabled`` a fit round runs in `fedloom.server.secure`
instead (SecAgg+ stage tasks through the same mailboxes; the server sees only the sum),
and its result is committed here like any other round.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from fedloom.config import ServerConfig
from fedloom.errors import (
    AggregationError,
    MessageRejectedError,
    PrivacyBudgetExhausted,
    RejectReason,
)
from fedloom.messages import (
    PROTOCOL_VERSION,
    JoinReply,
    JoinRequest,
    NoTask,
    ResultHeader,
    TaskHeader,
)
from fedloom.payload import PayloadInfo, deserialize, serialize
from fedloom.server.memory import release_free_heap
from fedloom.server.metrics import ServerMetrics
from fedloom.server.persistence import RunPersistence
from fedloom.server.progress import RoundReporter
from fedloom.server.quarantine import Quarantine
from fedloom.server.registry import ClientRecord, ClientRegistry
from fedloom.server.rounds import IssuedTask, RoundTasks, TaskStatus, updates_from_queue
from fedloom.server.secure import SECAGG_CAPABILITY, SecureRounds, StageTask
from fedloom.server.stragglers import ClosedTasks, over_select
from fedloom.server.uploads import Spool, SpooledWeights
from fedloom.strategies import Strategy
from fedloom.types import AggregateResult, ClientUpdate, EvaluateResult, Metrics, TaskKind
from fedloom.weights import Weights, layout_mismatch

log = logging.getLogger("fedloom.server")

#: ``evaluate_fn(server_round, weights) -> (loss, metrics)``, or None to skip.
EvaluateFn = Callable[[int, Weights], tuple[float, Metrics] | None]

CAPABILITIES = frozenset({"fit", "evaluate", SECAGG_CAPABILITY})


def _fingerprint(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


class PendingUpload:
    """A fit result whose header passed validation and whose chunks are arriving."""

    def __init__(self, task: IssuedTask, header: ResultHeader, spool: Spool) -> None:
        self.task = task
        self.header = header
        self.spool = spool


class Coordinator:
    def __init__(
        self,
        config: ServerConfig,
        strategy: Strategy,
        persistence: RunPersistence,
        *,
        evaluate_fn: EvaluateFn | None = None,
        reporter: RoundReporter | None = None,
    ) -> None:
        self.config = config
        self.strategy = strategy
        self.persistence = persistence
        self.evaluate_fn = evaluate_fn
        self.reporter = reporter or RoundReporter(enabled=False)
        self.registry = ClientRegistry(config.max_clients)
        self.quarantine = Quarantine(config.quarantine_after, config.quarantine_s)
        self.run_id = persistence.run_id
        self.finished = asyncio.Event()  # set only once the run is over and recorded
        self.stopping = False  # run() has ended, finished or not (e.g. the server stops)
        self.stopped_reason = ""  # why the run ended before num_rounds (the privacy budget)
        self.history: list[dict[str, Any]] = persistence.history()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aggregate")
        self._phase: RoundTasks | None = None
        # Accepted results of the last closed phase: task id -> (client id, fingerprint),
        # so a retry whose acknowledgement was lost is still answered "duplicate".
        self._recently_accepted: dict[str, tuple[str, bytes]] = {}
        self._closed_tasks = ClosedTasks()  # why unanswered tasks ended ("round closed")
        self._spool_dir = persistence.state_dir / "spool" / self.run_id
        # Secure fit rounds (SecAgg+), when config.secure_aggregation.enabled.
        self.secure = SecureRounds(config, self.run_id, self.registry, self._executor,
                                   self._spool_dir, strike=self._strike_id)
        self._set_global(persistence.weights)
        self.next_round = persistence.completed_round + 1

    # -- global model ---------------------------------------------------------------
    def _set_global(self, weights: Weights) -> None:
        # Let go of the old model before building the new payload: two copies at once,
        # not three (nothing else runs on the loop until this returns).
        self._payload = memoryview(b"")
        self.global_weights = self.persistence.weights = weights
        payload = serialize(weights)
        # Keep one copy: the global weights are views into the broadcast payload.
        self.global_weights = deserialize(weights.specs(), payload)
        self._payload = payload
        self._payload_info = PayloadInfo.describe(weights.specs(), payload)
        self.persistence.weights = self.global_weights  # not a second copy of the model

    @property
    def model_bytes(self) -> int:
        return self._payload_info.total_bytes

    # -- client calls ---------------------------------------------------------------
    def join(self, request: JoinRequest, identity: str | None = None) -> JoinReply:
        """Admit a client. An authenticated ``identity`` (`fedloom.server.auth`) names
        the session and holds one session at a time: joining again ends the old one."""
        if request.protocol_version != PROTOCOL_VERSION:
            raise MessageRejectedError(
                RejectReason.INVALID,
                f"protocol version {request.protocol_version} is not supported; "
                f"this server speaks {PROTOCOL_VERSION}: upgrade the client",
            )
        missing = {"fit"} - request.capabilities
        if missing:
            raise MessageRejectedError(RejectReason.INVALID, "a client must support 'fit'")
        self.quarantine.check(identity or request.name)
        for info in self.registry.infos() if identity is not None else ():
            if info.name == identity:
                self._drop_client(info.client_id, "replaced by a new session of its identity")
        record, session = self.registry.join(
            identity or request.name, request.capabilities & CAPABILITIES
        )
        log.info(
            "client %s (%s) joined; %d connected",
            record.client_id,
            record.info.name,
            len(self.registry),
            extra={"client": record.client_id, "client_name": record.info.name,
                   "connected": len(self.registry)},
        )
        ServerMetrics.clients.set(len(self.registry))
        t = self.config.transfer
        return JoinReply(
            session=session,
            protocol_version=PROTOCOL_VERSION,
            capabilities=CAPABILITIES,
            run_id=self.run_id,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            long_poll_s=self.config.long_poll_s,
            chunk_size=t.chunk_size,
            max_message_bytes=t.max_message_bytes,
            max_model_bytes=t.max_model_bytes,
        )

    def strike(self, record: ClientRecord, reason: RejectReason) -> None:
        """Count a refused message against its client; past the limit, quarantine its
        identity and end its sessions (`fedloom.server.quarantine`)."""
        name = record.info.name
        if self.quarantine.strike(name, reason):
            log.warning("client %s quarantined for %.0f s", name, self.quarantine.duration_s)
            for info in self.registry.infos():
                if info.name == name:
                    self._drop_client(info.client_id, "quarantined")

    def _strike_id(self, client_id: str, reason: RejectReason) -> None:
        record = self.registry.get(client_id)
        if record is not None:
            self.strike(record, reason)

    def stream_closed(self, record: ClientRecord) -> None:
        """The client's task stream (or long-poll) was cut: it is gone. Its session ends
        at once, so no round waits for it or samples it again (it joins afresh)."""
        self._drop_client(record.client_id, "its task stream ended")

    def heartbeat(self, session_client: ClientRecord) -> None:
        session_client.last_seen = time.monotonic()

    def leave(self, record: ClientRecord, reason: str) -> None:
        self._drop_client(record.client_id, f"left: {reason[:200]}" if reason else "left")

    async def pull(self, record: ClientRecord, sent: str | None = None
                   ) -> tuple[TaskHeader, memoryview] | NoTask:
        """Long-poll: the client's pending task, or `NoTask` after ``long_poll_s``.

        ``sent`` is the id of the task a Tasks stream sent last: the client is answering
        it, so that stream waits for the next one instead (a Pull re-offers a pending
        task until it is answered; a new stream starts with none sent).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.long_poll_s
        while True:
            offered = self.secure.offer(record.client_id)  # a secure round's stage task
            if offered is not None and offered[0].task_id != sent:
                return offered
            phase = self._phase
            task = phase.by_client.get(record.client_id) if phase and not phase.closed else None
            if (task is not None and task.status is TaskStatus.PENDING
                    and task.header.task_id != sent):
                return task.header, task.payload
            if self.finished.is_set():
                return NoTask(retry_after_s=0.0, run_finished=True)
            if self.stopping:  # stopped, not finished: the client must come back (reconnect)
                return NoTask(retry_after_s=0.0)
            if record.client_id not in self.registry:
                raise MessageRejectedError(RejectReason.UNKNOWN_CLIENT, "session ended; join again")
            remaining = deadline - loop.time()
            if remaining <= 0:
                return NoTask(retry_after_s=0.0)
            record.wakeup.clear()
            try:
                async with asyncio.timeout(remaining):
                    await record.wakeup.wait()
            except TimeoutError:
                return NoTask(retry_after_s=0.0)

    async def accept_result(
        self, record: ClientRecord, header: ResultHeader
    ) -> PendingUpload | bool:
        """`begin_result` for any task; a secure round's stage results go to it."""
        if not self.secure.owns(header.task_id):
            return self.begin_result(record, header)
        outcome = await self.secure.begin_result(record, header)
        return outcome if isinstance(outcome, bool) else PendingUpload(outcome[0], header,
                                                                       outcome[1])

    async def finish_upload(self, upload: PendingUpload, delta: SpooledWeights | None) -> None:
        """`finish_fit` for any upload; a masked input is folded into the secure sum."""
        if isinstance(upload.task, StageTask):
            await self.secure.finish_upload(upload.task, upload.header, upload.spool, delta)
        else:
            self.finish_fit(upload, delta)

    def begin_result(self, record: ClientRecord, header: ResultHeader) -> PendingUpload | bool:
        """Validate a result header. Returns a `PendingUpload` for a fit result whose
        chunks must follow, or whether an evaluate/failure result was a duplicate."""
        phase = self._phase
        task = phase.tasks.get(header.task_id) if phase else None
        if task is None or phase is None:
            accepted = self._recently_accepted.get(header.task_id)
            if accepted is not None and accepted[0] == record.client_id:
                if accepted[1] == self._result_fingerprint(header):
                    return True  # a retry after a lost acknowledgement; its round closed
                raise MessageRejectedError(
                    RejectReason.CONFLICT, "a different result was already accepted for this task"
                )
            closed = self._closed_tasks.reason(header.task_id, record.client_id)
            if closed is not None:
                raise MessageRejectedError(RejectReason.STALE, closed)
            raise MessageRejectedError(
                RejectReason.STALE,
                f"task {header.task_id[:40]!r} is not open (unknown, or its round has closed)",
            )
        if task.client_id != record.client_id:
            raise MessageRejectedError(
                RejectReason.FORBIDDEN, "that task was issued to another client"
            )
        if header.round != task.header.round:
            raise MessageRejectedError(
                RejectReason.STALE,
                f"result names round {header.round}, the task is for round {task.header.round}",
            )
        fingerprint = self._result_fingerprint(header)
        if task.status is TaskStatus.ACCEPTED:
            if fingerprint == task.result_fingerprint:
                return True  # an idempotent retry after a lost acknowledgement
            raise MessageRejectedError(
                RejectReason.CONFLICT, "a different result was already accepted for this task"
            )
        if phase.closed or task.status is not TaskStatus.PENDING:
            raise MessageRejectedError(
                RejectReason.STALE, f"round {phase.round} closed: {phase.end_reason(task)}"
            )
        if header.kind is None:
            log.warning("client %s reported a failure: %s", record.client_id, header.failure[:200])
            phase.fail(task, f"client failure: {header.failure[:200]}")
            return False
        if header.kind is not task.header.kind:
            raise MessageRejectedError(
                RejectReason.INVALID,
                f"a {header.kind} result was sent for a {task.header.kind} task",
            )
        self._check_num_examples(header.num_examples)
        if header.kind is TaskKind.EVALUATE:
            result = EvaluateResult(
                record.client_id, header.num_examples, header.loss, header.metrics
            )
            phase.accept_evaluation(task, result, fingerprint)
            self.reporter.progress(phase.round, phase.kind, phase.num_answered, len(phase.tasks))
            return False
        return self._begin_fit(record, task, header)

    def _begin_fit(
        self, record: ClientRecord, task: IssuedTask, header: ResultHeader
    ) -> PendingUpload:
        assert header.update is not None
        if header.base_round != task.header.round - 1:
            raise MessageRejectedError(
                RejectReason.STALE,
                f"update is based on round {header.base_round}; "
                f"this task trains the model of round {task.header.round - 1}",
            )
        limit = self.config.transfer.max_model_bytes
        if header.update.total_bytes > limit:
            raise MessageRejectedError(
                RejectReason.TOO_LARGE,
                f"update of {header.update.total_bytes} bytes exceeds max_model_bytes ({limit})",
            )
        problem = layout_mismatch(self._payload_info.specs, header.update.specs)
        if problem:
            raise MessageRejectedError(
                RejectReason.INVALID, f"update does not fit the model: {problem}"
            )
        if task.in_flight:
            raise MessageRejectedError(
                RejectReason.CONFLICT, "an upload for this task is already in progress"
            )
        task.in_flight = True
        spool = Spool(self._spool_dir, header.update, self.config.transfer.chunk_size)
        return PendingUpload(task, header, spool)

    def finish_fit(self, upload: PendingUpload, delta: SpooledWeights | None) -> None:
        """Fold a whole, verified upload into the round (or release a failed one)."""
        task = upload.task
        task.in_flight = False
        phase = self._phase
        if delta is None:
            # A client dropped mid-upload (left, quarantined) kept its task open for the
            # upload; with the upload gone, the task fails now, not at the deadline.
            gone = task.client_id not in self.registry
            if gone and phase is not None and phase.tasks.get(task.task_id) is task:
                phase.fail(task, "the client left while its upload was failing")
            return
        if phase is None or task.task_id not in phase.tasks or phase.closed:
            upload.spool.discard()
            raise MessageRejectedError(RejectReason.STALE, "the round closed while uploading")
        header = upload.header
        update = ClientUpdate(
            task.client_id, delta, header.num_examples, header.base_round, header.metrics
        )
        phase.accept_update(task, update, self._result_fingerprint(header))
        self.reporter.progress(phase.round, phase.kind, phase.num_answered, len(phase.tasks))

    def _check_num_examples(self, n: int) -> None:
        if not 0 < n <= self.config.max_num_examples:
            raise MessageRejectedError(
                RejectReason.INVALID,
                f"num_examples {n} is out of range (1..{self.config.max_num_examples})",
            )

    @staticmethod
    def _result_fingerprint(header: ResultHeader) -> bytes:
        metrics = sorted(header.metrics.items())
        sha = header.update.sha256 if header.update else b""
        return _fingerprint(
            header.kind, header.num_examples, header.base_round, header.loss, metrics, sha
        )

    # -- liveness -------------------------------------------------------------------
    def _drop_client(self, client_id: str, reason: str) -> None:
        if self.registry.remove(client_id) is None:
            return
        self.secure.drop(client_id, reason)
        log.info(
            "client %s removed (%s); %d connected", client_id, reason, len(self.registry),
            extra={"client": client_id, "reason": reason, "connected": len(self.registry)},
        )
        ServerMetrics.clients.set(len(self.registry))
        phase = self._phase
        task = phase.by_client.get(client_id) if phase else None
        if phase is not None and task is not None and not task.in_flight:
            phase.fail(task, reason)

    async def reap_clients(self) -> None:
        """Remove clients whose heartbeats and polls stopped."""
        while not self.finished.is_set():
            for client_id in self.registry.expired(self.config.client_timeout_s):
                self._drop_client(client_id, "no heartbeat")
            await asyncio.sleep(min(1.0, self.config.heartbeat_interval_s))

    # -- the rounds -----------------------------------------------------------------
    async def run(self) -> None:
        """Run rounds ``next_round..num_rounds``, then mark the run finished."""
        loop = asyncio.get_running_loop()
        reaper = asyncio.create_task(self.reap_clients())
        try:
            if self.next_round == 1 and not self.history:
                initial = await self._server_evaluate(0, self.global_weights)
                if initial:
                    self.history.append({"round": 0, "status": "ok", "server": initial})
                    self.reporter.round_finished(self.history[-1])
            for server_round in range(self.next_round, self.config.num_rounds + 1):
                try:
                    await self._run_round(loop, server_round)
                except PrivacyBudgetExhausted as exc:
                    # Raised before the round's tasks go out: the last committed round is
                    # the run's final model, and nothing past the budget is released.
                    log.warning("run ends before round %d: %s", server_round, exc)
                    self.stopped_reason = str(exc)
                    break
            self.persistence.finish()
            self.finished.set()
        finally:
            # A stop (cancel, signal) is not the end of the run: clients told "finished"
            # would leave for good and the restarted server would wait for them forever.
            self.stopping = True
            for record in list(self.registry.infos()):
                client = self.registry.get(record.client_id)
                if client:
                    client.wakeup.set()
            reaper.cancel()
            self._executor.shutdown(wait=False)

    async def _wait_for_clients(self) -> None:
        while len(self.registry) < self.config.min_clients:
            self.reporter.waiting(len(self.registry), self.config.min_clients)
            self.registry.changed.clear()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel
            # that lands as a client joins, and the server then never stops.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await self.registry.changed.wait()

    async def _run_round(self, loop: asyncio.AbstractEventLoop, server_round: int) -> None:
        await self._wait_for_clients()
        started = time.time()
        current = self.global_weights
        if self.secure.enabled:  # SecAgg+: server/secure/
            self.reporter.round_started(server_round, self.config.num_rounds,
                                        self.config.min_fit_clients)
            secure_result, secure_record = await self.secure.run_round(
                server_round, current, self.strategy, self._payload, self._payload_info)
            self._clean_spool()
            await self._conclude_round(loop, server_round, started, secure_result, secure_record)
            return
        plan = self.strategy.configure_fit(server_round, current, self.registry.infos())
        selection = over_select(
            plan.client_ids,
            self.registry.infos(),
            self.config.over_selection,
            seed=self.config.seed,
            server_round=server_round,
        )
        phase = self._open_phase(
            server_round,
            TaskKind.FIT,
            selection.client_ids,
            plan.config,
            self.config.min_fit_clients,
            self.config.round_timeout_s,
            target=selection.target,
        )
        self.reporter.round_started(server_round, self.config.num_rounds, len(phase.tasks))
        aggregate = loop.run_in_executor(
            self._executor,
            self.strategy.aggregate_fit,
            server_round,
            current,
            updates_from_queue(phase.updates),
        )
        try:
            await phase.wait(self.config.round_timeout_s)
        except BaseException:  # cancelled (server stopping): release the aggregation thread
            phase.abort("the server is stopping")
            raise
        release_free_heap()  # uploads are in: drop their buffers' pages before the peak
        result: AggregateResult | None
        try:
            result = await aggregate
        except AggregationError as exc:
            log.warning("round %d failed: %s; the global model is unchanged", server_round, exc)
            result = None
        finally:
            self._close_phase(phase)
            self._clean_spool()
        del current  # the old model; the round's tasks let go of it in _close_phase
        record: dict[str, Any] = {
            "round": server_round,
            "num_sampled": len(phase.tasks),
            "num_updates": phase.num_accepted,
            "num_failures": len(phase.failures),
            "num_cancelled": phase.num_cancelled,
        }
        await self._conclude_round(loop, server_round, started, result, record)

    async def _conclude_round(
        self,
        loop: asyncio.AbstractEventLoop,
        server_round: int,
        started: float,
        result: AggregateResult | None,
        record: dict[str, Any],
    ) -> None:
        """Install the new model (if any), evaluate, and commit the round."""
        if result is not None and result.weights is None:
            log.warning("round %d produced no model: %s", server_round, result.reason)
        if result is not None and result.weights is not None:
            self._set_global(result.weights)
            record["status"] = "ok"
            record["fit"] = dict(result.metrics)
            record["evaluate"] = await self._federated_evaluate(server_round)
            record["server"] = await self._server_evaluate(server_round, self.global_weights)
        else:
            record["status"] = "failed"
        record["duration_s"] = time.time() - started
        await loop.run_in_executor(
            self._executor,
            self.persistence.commit,
            server_round,
            record["status"],
            self.global_weights,
            self.strategy.state_dict(),
            record,
            started,
        )
        self.history.append(record)
        epsilon = record.get("fit", {}).get("privacy_epsilon")
        ServerMetrics.round_done(record["status"], record["duration_s"], server_round, epsilon)
        self.reporter.round_finished(record)

    def _close_phase(self, phase: RoundTasks) -> None:
        self._phase = None
        for task in phase.tasks.values():
            task.payload = memoryview(b"")  # a closed task is never sent: drop the model
        self._closed_tasks.remember(phase)
        ServerMetrics.tasks_closed(str(phase.kind), phase.outcomes())
        self._recently_accepted = {
            t.task_id: (t.client_id, t.result_fingerprint)
            for t in phase.tasks.values()
            if t.status is TaskStatus.ACCEPTED
        }

    def _open_phase(
        self,
        server_round: int,
        kind: TaskKind,
        client_ids: tuple[str, ...],
        config: Any,
        minimum: int,
        timeout_s: float,
        target: int | None = None,
    ) -> RoundTasks:
        phase = RoundTasks(server_round, kind, minimum, target)
        for client_id in client_ids:
            client = self.registry.get(client_id)
            if client is None:
                continue
            header = TaskHeader(
                task_id=secrets.token_hex(16),
                run_id=self.run_id,
                round=server_round,
                kind=kind,
                config=config,
                deadline_s=timeout_s,
                weights=self._payload_info,
            )
            phase.add(IssuedTask(header, client_id, self._payload))
            client.wakeup.set()
        self._phase = phase
        return phase

    async def _federated_evaluate(self, server_round: int) -> dict[str, Any]:
        eligible = [c for c in self.registry.infos() if "evaluate" in c.capabilities]
        plan = self.strategy.configure_evaluate(server_round, self.global_weights, eligible)
        if not plan.client_ids:
            return {}
        phase = self._open_phase(
            server_round,
            TaskKind.EVALUATE,
            plan.client_ids,
            plan.config,
            self.config.min_evaluate_clients,
            self.config.evaluate_timeout_s,
        )
        try:
            enough = await phase.wait(self.config.evaluate_timeout_s)
        finally:
            self._close_phase(phase)
        if not enough:
            log.warning(
                "round %d: only %d evaluation results; skipping federated metrics",
                server_round,
                len(phase.evaluations),
            )
            return {}
        return dict(self.strategy.aggregate_evaluate(server_round, phase.evaluations))

    async def _server_evaluate(self, server_round: int, weights: Weights) -> dict[str, Any]:
        if self.evaluate_fn is None:
            return {}
        loop = asyncio.get_running_loop()
        outcome = await loop.run_in_executor(
            self._executor, self.evaluate_fn, server_round, weights
        )
        if outcome is None:
            return {}
        loss, metrics = outcome
        return {"loss": float(loss), **dict(metrics)}

    def _clean_spool(self) -> None:
        if self._spool_dir.is_dir():
            for path in self._spool_dir.glob("upload-*.bin"):
                path.unlink(missing_ok=True)
