"""The plain round driver: fit tasks to sampled clients, updates folded as they arrive.

Each round: the strategy samples and configures the fit; over-selection adds a few
clients (`fedloom.server.stragglers`); the tasks go out through the task book; each
verified update is handed to the strategy's aggregation, running in a worker thread, as
it arrives (a stream); the round closes at the first of "all answered", "enough
answered" (over-selection) or the deadline with at least ``min_fit_clients``.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from fedloom.errors import AggregationError, MessageRejectedError, RejectReason
from fedloom.messages import ResultHeader, TaskHeader
from fedloom.server.client_metrics import fit_row, records_per_client
from fedloom.server.compression import (
    EncodingRefusedError,
    broadcast,
    check_decodes,
    check_encoding,
    check_zstd,
)
from fedloom.server.driver import FitOutcome, RoundDriver, RoundParts
from fedloom.server.memory import release_free_heap
from fedloom.server.metrics import ServerMetrics
from fedloom.server.registry import ClientRecord
from fedloom.server.rounds import Aggregation, RoundTasks, updates_from_queue
from fedloom.server.store import ClientRow
from fedloom.server.stragglers import over_select
from fedloom.server.tasks import Task, TaskStatus
from fedloom.server.uploads import Spool, SpooledWeights, Upload
from fedloom.types import AggregateResult, ClientUpdate, TaskKind
from fedloom.weights import layout_mismatch

log = logging.getLogger("fedloom.server")


def issue_phase(parts: RoundParts, phase: RoundTasks, owner: Any, client_ids: tuple[str, ...],
                config: Any, deadline_s: float) -> None:
    """Issue one task per connected client of ``client_ids`` into ``phase``, each
    carrying the global model, encoded with the client's download codec if it was
    granted one (shared by plain fit and evaluation phases)."""
    for client_id in client_ids:
        record = parts.fleet.registry.get(client_id)
        if record is None:
            continue
        info, payload, codec, decoded = broadcast(parts.model, record.download_codec,
                                                  record.download_zstd)
        header = TaskHeader(
            task_id=secrets.token_hex(16), run_id=parts.run_id, round=phase.round,
            kind=phase.kind, config=config, deadline_s=deadline_s, weights=info,
            codec=codec, decoded=decoded,
        )
        task = Task(header, client_id, payload)
        phase.add(task)
        parts.book.issue(task, owner)


def check_num_examples(parts: RoundParts, n: int) -> None:
    limit = parts.config.max_num_examples
    if not 0 < n <= limit:
        raise MessageRejectedError(
            RejectReason.INVALID, f"num_examples {n} is out of range (1..{limit})")


def start_fit_upload(parts: RoundParts, client: ClientRecord, task: Task,
                     header: ResultHeader, fingerprint: bytes) -> Upload:
    """Check a fit result's header against its task; the `Upload` its payload fills.

    Raises:
        MessageRejectedError: no update, a bad ``num_examples``, an update not based on
            the task's model, too large, of another layout, or a second upload at once.
        EncodingRefusedError: a codec the client was not granted, or an encoded payload
            of another layout (`fedloom.server.compression.check_encoding`).
    """
    check_num_examples(parts, header.num_examples)
    if header.update is None:
        raise MessageRejectedError(RejectReason.INVALID, "a fit result carries an update")
    if header.base_round != task.header.round - 1:
        raise MessageRejectedError(
            RejectReason.STALE,
            f"update is based on round {header.base_round}; "
            f"this task trains the model of round {task.header.round - 1}",
        )
    transfer = parts.config.transfer
    if header.update.total_bytes > transfer.max_model_bytes:
        raise MessageRejectedError(
            RejectReason.TOO_LARGE, f"update of {header.update.total_bytes} bytes exceeds "
            f"max_model_bytes ({transfer.max_model_bytes})")
    check_zstd(client.upload_zstd, header)
    if header.codec is not None:
        check_encoding(client.upload_codec, header, task.header.model_specs)
    else:
        problem = layout_mismatch(task.header.model_specs, header.update.specs)
        if problem:
            raise MessageRejectedError(
                RejectReason.INVALID, f"update does not fit the model: {problem}")
    if task.in_flight:
        raise MessageRejectedError(
            RejectReason.CONFLICT, "an upload for this task is already in progress")
    spool = Spool(parts.spool_dir, header.update, transfer.chunk_size)
    return Upload(task, header, spool, fingerprint)


def refusal_ends_task(exc: MessageRejectedError) -> bool:
    """Whether a fit result refused at its header ends its task: one refused for what it
    is (layout, size, base round, examples, encoding) does, since the client does not
    send a refused result again and the round would wait for it until its deadline; a
    second upload while one runs (CONFLICT) does not."""
    return exc.reason is not RejectReason.CONFLICT


class PhaseOwner:
    """The task owner of a plain phase: what is common to fit and evaluate results."""

    def __init__(self, parts: RoundParts, phase: RoundTasks) -> None:
        self.parts = parts
        self.phase = phase

    @property
    def accepting(self) -> bool:
        return not self.phase.closed

    def failed(self, task: Task, message: str) -> None:
        log.warning("client %s reported a failure: %s", task.client_id, message)
        self.phase.fail(task, f"client failure: {message}")

    def client_gone(self, task: Task, reason: str) -> None:
        self.phase.fail(task, reason)

    def end_reason(self, task: Task) -> str:
        return f"round {self.phase.round} closed: {self.phase.end_reason(task)}"

    def needless(self, task: Task, header: ResultHeader) -> bool:
        return False

    def progress(self) -> None:
        phase = self.phase
        self.parts.reporter.progress(phase.round, phase.kind, phase.num_answered,
                                     len(phase.tasks))

    def close(self) -> None:
        self.parts.book.close(self.phase.tasks.values())
        ServerMetrics.tasks_closed(str(self.phase.kind), self.phase.outcomes())


class FitPhase(PhaseOwner):
    """The fit tasks of one plain round: checks each update's header, then folds it."""

    def __init__(self, parts: RoundParts, phase: RoundTasks) -> None:
        super().__init__(parts, phase)
        #: A row per accepted update, when the run keeps per-client metrics.
        self.clients: list[ClientRow] | None = (
            [] if records_per_client(parts.config, parts.strategy) else None)

    async def take(self, client: ClientRecord, task: Task, header: ResultHeader,
                   fingerprint: bytes) -> Upload | bool:
        try:
            return start_fit_upload(self.parts, client, task, header, fingerprint)
        except MessageRejectedError as exc:
            if refusal_ends_task(exc):
                self.refused(task, exc)
            raise

    def refused(self, task: Task, exc: MessageRejectedError) -> None:
        """An update refused for what it is fails its task (the round goes on)."""
        log.warning("client %s: %s", task.client_id, exc)
        self.phase.fail(task, f"update refused: {exc}")
        self.progress()

    async def fold(self, upload: Upload, payload: SpooledWeights) -> None:
        task, header = upload.task, upload.header
        try:
            delta = await check_decodes(header.codec, task.header.model_specs, payload)
        except EncodingRefusedError as exc:
            upload.spool.discard()
            if task.status is TaskStatus.PENDING and not self.phase.closed:
                self.refused(task, exc)
            raise
        if self.phase.closed or task.status is not TaskStatus.PENDING:
            upload.spool.discard()
            raise MessageRejectedError(RejectReason.STALE, "the round closed while uploading")
        update = ClientUpdate(task.client_id, delta, header.num_examples, header.base_round,
                              header.metrics)
        self.phase.accept_update(task, update, upload.fingerprint)
        if self.clients is not None:
            self.clients.append(fit_row(self.parts.fleet.registry, task.client_id,
                                        header.num_examples, header.metrics))
        self.progress()

    def abandoned(self, upload: Upload) -> None:
        # A client that left mid-upload kept its task open for the upload; with the
        # upload gone, the task fails now, not at the deadline.
        task = upload.task
        if upload.refusal is not None and task.status is TaskStatus.PENDING \
                and not self.phase.closed:
            self.refused(task, upload.refusal)  # a compressed stream that did not hold up
        elif task.client_id not in self.parts.fleet.registry and not self.phase.closed:
            self.phase.fail(task, "the client left while its upload was failing")


class PlainRounds(RoundDriver):
    """Plain (not secure-aggregated) fit rounds."""

    async def run_fit(self, server_round: int) -> FitOutcome:
        parts, config = self.parts, self.parts.config
        current = parts.model.weights
        connected = parts.fleet.registry.infos()
        plan = parts.strategy.configure_fit(server_round, current, connected)
        selection = over_select(plan.client_ids, connected, config.over_selection,
                                seed=config.seed, server_round=server_round)
        phase = RoundTasks(server_round, TaskKind.FIT, config.min_fit_clients,
                           selection.target)
        owner = FitPhase(parts, phase)
        issue_phase(parts, phase, owner, selection.client_ids, plan.config,
                    config.round_timeout_s)
        parts.reporter.round_started(server_round, config.num_rounds, len(phase.tasks))
        aggregation = Aggregation(parts.executor, parts.strategy.aggregate_fit, server_round,
                                  current, updates_from_queue(phase.updates))
        try:
            await phase.wait(config.round_timeout_s)
        except BaseException:  # cancelled (server stopping): release the aggregation thread
            phase.abort("the server is stopping")
            aggregation.abandon()  # its RoundAbortedError is expected, and not awaited
            raise
        release_free_heap()  # uploads are in: drop their buffers' pages before the peak
        result: AggregateResult | None
        try:
            result = await aggregation.result
        except AggregationError as exc:  # the round fails with it (logged at its commit)
            result = AggregateResult.failed(exc, phase.num_accepted)
        finally:
            owner.close()
            self.clean_spool()
        return FitOutcome(result, num_sampled=len(phase.tasks), num_updates=phase.num_accepted,
                          num_failures=len(phase.failures), num_cancelled=phase.num_cancelled,
                          clients=owner.clients or [])
