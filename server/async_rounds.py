"""Buffered asynchronous rounds (FedBuff): clients train all the time, and the model
takes a step every ``buffer_size`` updates.

Nguyen et al., AISTATS 2022 ("Federated Learning with Buffered Asynchronous
Aggregation"). ``rounds.concurrency`` clients hold a fit task at any time; each task
trains the global model current when it was issued (its round is that version + 1, so
the update's ``base_round`` names the version). A verified update is made durable
(`fedloom.server.async_buffer`) and then acknowledged; it joins the open buffer, whose
updates stream into the strategy's aggregation in the aggregation thread, each scaled by
its staleness weight (`fedloom.strategies.StalenessWeighting`). When the buffer holds
``buffer_size`` updates the strategy's server optimizer steps, and the round loop
commits the result as a model version (a round: checkpoint, then SQLite). Updates that
arrive meanwhile fill the next buffer, and whoever returned a task is free for the next
one, on the newest model (while a step is being taken, new tasks wait for the model it
produces; the idle clients are sampled, seeded, when fewer than ``concurrency`` train).

Staleness is counted in versions: an update trained on version ``tau`` that joins the
buffer of version ``v`` (applied to version ``v - 1``) has staleness ``v - 1 - tau``;
beyond ``rounds.max_staleness`` it is refused (STALE, the buffer untouched). A task with
no result ``round_timeout_s`` after it was issued fails and frees its slot.

Every mean-based strategy composes (FedAvg, FedAvgM, FedProx, the FedOpt family: the
strategy's weighted mean of staleness-scaled deltas, then its optimizer); a robust rule
holds the buffer's updates (its aggregator's ``holds_all_updates``), which the log says.
Encoded updates (``[compression] upload``) are checked to decode before they are made
durable, stay encoded in the buffer, and reach the strategy decoded, tensor by tensor.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import secrets
from typing import Any

from fedloom.errors import (
    AggregationError,
    ClientsUnavailableError,
    MessageRejectedError,
    RejectReason,
)
from fedloom.messages import ResultHeader, TaskHeader
from fedloom.server.async_buffer import BufferEntry, DurableBuffer, StepBuffer, sync_file
from fedloom.server.client_metrics import fit_row, records_per_client
from fedloom.server.compression import (
    EncodingRefusedError,
    broadcast,
    check_decodes,
    download_grants,
    grant_of,
)
from fedloom.server.crashpoints import crashpoint
from fedloom.server.driver import FitOutcome, RoundDriver, RoundParts
from fedloom.server.fleet import WAIT_LOG_S
from fedloom.server.memory import release_free_heap
from fedloom.server.metrics import ServerMetrics
from fedloom.server.persistence import RunPersistence
from fedloom.server.plain_round import refusal_ends_task, start_fit_upload
from fedloom.server.registry import ClientRecord
from fedloom.server.rounds import Aggregation, end_stream, updates_from_queue
from fedloom.server.tasks import Task, TaskStatus
from fedloom.server.uploads import SpooledWeights, Upload
from fedloom.strategies import (
    StalenessWeighting,
    check_robust_async,
    holds_all_updates,
    weighted_updates,
)
from fedloom.types import AggregateResult, TaskKind

log = logging.getLogger("fedloom.server")

#: Seconds between checks for overdue tasks and idle clients while a buffer fills.
POLL_S = 0.5


class AsyncRounds(RoundDriver):
    """Buffered asynchronous fit (see the module docstring); owns its fit tasks."""

    def __init__(self, parts: RoundParts, persistence: RunPersistence) -> None:
        super().__init__(parts)
        self.settings = settings = parts.config.rounds
        self.weighting = StalenessWeighting.from_config(settings)
        config = parts.config
        if config.fraction_evaluate > 0 and settings.concurrency >= config.min_clients:
            # Evaluation asks only clients that hold no task, and a freed client gets a
            # new one before the committed version is evaluated.
            log.warning("federated evaluation asks clients that are not training, but "
                        "rounds.concurrency (%d) is at least min_clients (%d): with every "
                        "client training, versions may go unevaluated until the last; keep "
                        "concurrency below the fleet's size, or evaluate on the server "
                        "(evaluate_fn)", settings.concurrency, config.min_clients)
        self.last_version = settings.last_round(parts.config.num_rounds)
        self.durable = DurableBuffer(persistence.store, persistence.state_dir, parts.run_id,
                                     parts.model.weights.specs())
        self._rng = random.Random(parts.config.seed)
        self.owner = AsyncFitTasks(self)
        self._running: dict[str, Task] = {}  # pending fit tasks by id
        # Task id -> who its update counts against, fixed when it was issued (a client
        # that joins again while its upload runs keeps the identity it had).
        self._task_contributors: dict[str, str] = {}
        self._short_since: float | None = None  # when the open buffer became unfillable
        self._short_logged: float | None = None  # when that was last logged
        self._deadlines: dict[str, float] = {}  # task id -> loop time of its deadline
        self._ended: list[Task] = []  # failed or refused: closed at the next commit
        self._reasons: dict[str, str] = {}  # why an ended task ended
        self._config_cache: tuple[int, Any] | None = None
        self._preparing: asyncio.Task[None] | None = None  # building broadcasts (`_prepare`)
        self._buffers: dict[int, StepBuffer] = {}
        #: The last step is full (or the run is over): no new tasks, no more results.
        self.done = False
        self.num_accepted = 0  # updates acknowledged by this server process
        first = persistence.completed_round + 1
        self._open = self._buffer(first)
        if not persistence.finished:  # a finished run trains nothing, and keeps its files
            for entry in self.durable.recover(persistence.completed_round):
                self._enter(entry, None)
        check_robust_async(parts.strategy, settings)
        if holds_all_updates(parts.strategy):
            log.info("async rounds: %s holds every update of a step in memory "
                     "(buffer_size = %d)", type(parts.strategy).__name__, settings.buffer_size)

    # -- the round loop's side ------------------------------------------------------
    async def run_fit(self, server_round: int) -> FitOutcome:
        parts = self.parts
        buffer = self._buffer(server_round)
        parts.reporter.round_started(server_round, self.last_version, self.settings.buffer_size)
        current = parts.model.weights  # the version this step updates
        self._top_up()
        loop = asyncio.get_running_loop()
        aggregation = Aggregation(
            parts.executor, parts.strategy.aggregate_fit, server_round, current,
            weighted_updates(updates_from_queue(buffer.updates), self.weighting))
        try:
            while not buffer.full.is_set():
                self._expire_overdue(loop.time())
                self._top_up()
                self._check_fillable(buffer, loop.time())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(POLL_S):
                        await buffer.full.wait()
        except BaseException:  # cancelled (server stopping): release the aggregation thread
            end_stream(buffer.updates, "the server is stopping")
            aggregation.abandon()
            raise
        release_free_heap()
        result: AggregateResult | None
        try:
            result = await aggregation.result
        except AggregationError as exc:  # the version fails with it (logged at its commit)
            result = AggregateResult.failed(exc, buffer.count)
        keep = records_per_client(parts.config, parts.strategy)
        clients = [fit_row(parts.fleet.registry, e.row.client_id, e.row.num_examples,
                           e.row.metrics) for e in buffer.entries] if keep else []
        return FitOutcome(result, num_sampled=buffer.count + buffer.num_failures,
                          num_updates=buffer.count, num_failures=buffer.num_failures,
                          clients=clients)

    def model_ready(self, server_round: int) -> None:
        """Round ``server_round``'s model is installed: the free clients train it."""
        self._top_up()

    def committed(self, server_round: int) -> None:
        """Version ``server_round`` is durable: forget its updates, close its tasks."""
        buffer = self._buffers.pop(server_round, None)
        self.durable.forget(server_round)
        closing = list(buffer.tasks if buffer is not None else ()) + self._ended
        self._ended = []
        self.parts.book.close(closing)
        for task in closing:
            self._reasons.pop(task.task_id, None)
        ServerMetrics.tasks_closed(str(TaskKind.FIT), _outcomes(closing))

    def finish(self) -> None:
        """The run is over: end the tasks in flight and drop the updates no step needs."""
        self.done = True
        for task in list(self._running.values()):
            self.end(task, "the run has finished")
        closing = self._ended + [t for b in self._buffers.values() for t in b.tasks]
        self.parts.book.close(closing)
        self._ended = []
        for buffer in self._buffers.values():
            end_stream(buffer.updates, "the run has finished")
        self._buffers.clear()
        self.durable.forget()

    def close(self) -> None:
        self.done = True  # stopping: the durable buffer stays for a restart
        if self._preparing is not None:
            self._preparing.cancel()

    # -- the fit tasks' results (through `AsyncFitTasks`, their task owner) ----------
    async def take(self, client: ClientRecord, task: Task, header: ResultHeader,
                   fingerprint: bytes) -> Upload:
        self._check_fresh(task, self._open)
        try:
            return start_fit_upload(self.parts, client, task, header, fingerprint)
        except MessageRejectedError as exc:
            if refusal_ends_task(exc):  # its slot goes to fresh work, not at its deadline
                log.warning("client %s: %s", task.client_id, exc)
                self.end(task, f"update refused: {exc}")
            raise

    async def fold(self, upload: Upload, payload: SpooledWeights) -> None:
        task, header = upload.task, upload.header
        try:
            self._check_open(task)
            try:
                await check_decodes(header.codec, task.header.model_specs, payload)
            except EncodingRefusedError as exc:
                log.warning("client %s: %s", task.client_id, exc)
                self.end(task, f"update refused: {exc}")
                raise
            # The bytes reach the disk before anything is acknowledged (off the loop).
            await asyncio.to_thread(sync_file, upload.spool.path)
            self._check_open(task)
            buffer = self._open
            staleness = self._check_fresh(task, buffer)
            assert header.update is not None  # start_fit_upload checked it
            metrics = {**header.metrics, "staleness": staleness}
            entry = self.durable.keep(buffer.version, task.client_id, task.header.round - 1,
                                      header.num_examples, metrics, upload.spool.path,
                                      header.update, header.codec,
                                      self._task_contributor(task))
        except BaseException:
            upload.spool.discard()
            raise
        crashpoint("async_update_kept")
        task.settle(TaskStatus.ACCEPTED, upload.fingerprint)
        self._forget(task)
        self.num_accepted += 1
        self._enter(entry, task)
        self._top_up()

    def abandoned(self, upload: Upload) -> None:
        task = upload.task
        if upload.refusal is not None:  # a compressed stream that did not hold up
            log.warning("client %s: %s", task.client_id, upload.refusal)
            self.end(task, f"update refused: {upload.refusal}")
        elif task.client_id not in self.parts.fleet.registry:
            self.end(task, "the client left while its upload was failing")

    def failed(self, task: Task, message: str) -> None:
        log.warning("client %s reported a failure: %s", task.client_id, message)
        self.end(task, f"client failure: {message}")

    def end_reason(self, task: Task) -> str:
        return self._reasons.get(task.task_id, "the run has all the updates it needs")

    # -- internals --------------------------------------------------------------------
    def _buffer(self, version: int) -> StepBuffer:
        buffer = self._buffers.get(version)
        if buffer is None:
            buffer = self._buffers[version] = StepBuffer(version, self.settings.buffer_size)
        return buffer

    def _enter(self, entry: BufferEntry, task: Task | None) -> None:
        """Put a durable update into the open buffer; a full buffer opens the next."""
        buffer = self._open
        buffer.entries.append(entry)
        buffer.contributors[entry.contributor] += 1
        if task is not None:
            buffer.tasks.append(task)
        buffer.updates.put(entry.update())
        self.parts.reporter.progress(buffer.version, TaskKind.FIT, buffer.count, buffer.size)
        if buffer.count < buffer.size:
            return
        end_stream(buffer.updates)
        buffer.full.set()
        if buffer.version >= self.last_version:
            self.done = True  # the last step has its updates: no more tasks
            return
        self._open = self._buffer(buffer.version + 1)
        # Tasks that can no longer be taken end now: their slots go to fresh work, and
        # the model versions they hold in memory are let go (at most max_staleness + 2
        # versions are ever held for tasks in flight).
        for task in list(self._running.values()):
            if not task.in_flight and self._open.staleness(
                    task.header.round - 1) > self.settings.max_staleness:
                self.end(task, f"its model (version {task.header.round - 1}) became more "
                               f"than rounds.max_staleness = {self.settings.max_staleness} "
                               "versions old before it answered")

    def _check_open(self, task: Task) -> None:
        if task.status is not TaskStatus.PENDING or self.done:
            raise MessageRejectedError(RejectReason.STALE, self.end_reason(task))

    def _check_fresh(self, task: Task, buffer: StepBuffer) -> int:
        """The staleness of ``task``'s update in ``buffer``; too stale ends the task."""
        base = task.header.round - 1
        staleness = buffer.staleness(base)
        limit = self.settings.max_staleness
        if staleness > limit:
            reason = (f"update trained on version {base} is {staleness} versions old (the "
                      f"next step updates version {buffer.version - 1}); rounds.max_staleness "
                      f"is {limit}")
            self.end(task, reason)
            raise MessageRejectedError(RejectReason.STALE, reason)
        return staleness

    def end(self, task: Task, reason: str) -> None:
        """A pending task failed (or was refused): its slot is free for another client."""
        if task.status is not TaskStatus.PENDING:
            return
        task.settle(TaskStatus.FAILED)
        self._reasons[task.task_id] = reason
        self._forget(task)
        self._ended.append(task)
        self._open.num_failures += 1

    def _expire_overdue(self, now: float) -> None:
        for task_id, deadline in list(self._deadlines.items()):
            task = self._running.get(task_id)
            if task is not None and deadline <= now and not task.in_flight:
                self.end(task, "no result before the deadline (round_timeout_s)")

    def _top_up(self) -> None:
        """Issue fit tasks to idle clients until ``concurrency`` are training."""
        if self.done or self._open.version - 1 > self.parts.model.version:
            return  # a step is pending: new tasks wait for the model it produces
        need = self.settings.concurrency - len(self._running)
        if need <= 0:
            return
        parts = self.parts
        registry, current = parts.fleet.registry, parts.model.current
        idle = sorted((info for info in registry.infos()
                       if not parts.book.busy(info.client_id)),
                      key=lambda info: (info.name, info.client_id))
        idle = self._under_cap(idle)
        # A session that joined after this version was published may hold a grant whose
        # broadcast is not built yet: it is built in the executor, and that session
        # gets its task once it is (the loop never encodes a model).
        ready = [info for info in idle if current.ready(grant_of(registry.get(info.client_id)))]
        if len(ready) < len(idle):
            self._prepare_broadcasts()
        chosen = ready if len(ready) <= need else self._rng.sample(ready, need)
        for info in chosen:
            self._issue(info.client_id)

    def _contributor(self, client_id: str) -> str:
        """Who a client's updates count against in ``rounds.max_updates_per_client``: its
        authenticated identity (all its sessions together), else its session."""
        record = self.parts.fleet.registry.get(client_id)
        return (record.identity or client_id) if record is not None else client_id

    def _check_fillable(self, buffer: StepBuffer, now: float) -> None:
        """With ``max_updates_per_client``, whether the connected clients can still fill
        ``buffer``: its tasks in flight, plus what each connected contributor may still
        add. When they cannot, the server waits as it waits for ``min_clients``: it
        says so (every `WAIT_LOG_S`), and stops after ``min_clients_wait_s`` when set.

        Raises:
            ClientsUnavailableError: too few clients for ``min_clients_wait_s``.
        """
        cap = self.settings.max_updates_per_client
        if not cap or self.done:
            return
        held = self._held()
        keys = {self._contributor(info.client_id)
                for info in self.parts.fleet.registry.infos()}
        supply = len(self._running) + sum(max(0, cap - held[key]) for key in keys)
        needed = buffer.size - buffer.count
        if supply >= needed:
            self._short_since = None
            return
        if self._short_since is None:
            self._short_since, self._short_logged = now, None
        waited = now - self._short_since
        limit = self.parts.config.min_clients_wait_s
        if limit and waited >= limit:
            raise ClientsUnavailableError(
                f"version {buffer.version} needs {needed} more updates and the connected "
                f"clients can send {supply} (rounds.max_updates_per_client = {cap}) within "
                f"min_clients_wait_s ({limit:g} s); the server stops with every committed "
                "version kept: start it again when the clients can come (it resumes)")
        if self._short_logged is None or now - self._short_logged >= WAIT_LOG_S:
            log.info("waiting for clients: version %d needs %d more updates, the connected "
                     "clients can send %d (rounds.max_updates_per_client = %d; waited %.0f s)",
                     buffer.version, needed, supply, cap, waited,
                     extra={"needed": needed, "available": supply})
            self._short_logged = now
        self.parts.reporter.waiting(supply, needed)

    def _forget(self, task: Task) -> None:
        """``task`` no longer runs (accepted, failed or refused)."""
        self._running.pop(task.task_id, None)
        self._deadlines.pop(task.task_id, None)
        self._task_contributors.pop(task.task_id, None)

    def _task_contributor(self, task: Task) -> str:
        """Whom a running task's update counts against (recorded when it was issued)."""
        return self._task_contributors[task.task_id]

    def _held(self) -> collections.Counter[str]:
        """Updates each contributor has in the open buffer, plus its tasks in flight."""
        held = collections.Counter(self._open.contributors)
        for task in self._running.values():
            held[self._task_contributor(task)] += 1
        return held

    def _under_cap(self, idle: list[Any]) -> list[Any]:
        """The idle clients that may still add an update to the open buffer: its updates
        from them plus their tasks in flight stay within ``max_updates_per_client`` (an
        update lands in the buffer open when it arrives, or a later, emptier one)."""
        cap = self.settings.max_updates_per_client
        if not cap:
            return idle
        held = self._held()
        out = []
        for info in idle:
            key = self._contributor(info.client_id)
            if held[key] < cap:
                held[key] += 1  # a second session of the same identity counts here too
                out.append(info)
        return out

    def _prepare_broadcasts(self) -> None:
        """Build what the held grants lack in the executor (one build at a time), then
        top up again."""
        if self._preparing is None or self._preparing.done():
            self._preparing = asyncio.get_running_loop().create_task(self._prepare())

    async def _prepare(self) -> None:
        parts = self.parts
        try:  # not in the aggregation thread: a step's aggregation holds it until it fills
            await parts.model.prepare(lambda: download_grants(parts.fleet.registry), None)
        except RuntimeError:  # a new version is being published: it prepares the grants
            return
        except Exception:  # the waiting sessions get no task until a build succeeds
            log.exception("building the broadcast for newly held download grants failed")
            return
        self._top_up()

    def _issue(self, client_id: str) -> None:
        parts = self.parts
        model = parts.model
        server_round = model.version + 1
        record = parts.fleet.registry.get(client_id)
        info, payload, codec, decoded = broadcast(model, *grant_of(record))
        header = TaskHeader(
            task_id=secrets.token_hex(16), run_id=parts.run_id, round=server_round,
            kind=TaskKind.FIT, config=self._fit_config(server_round),
            deadline_s=parts.config.round_timeout_s, weights=info, codec=codec,
            decoded=decoded)
        task = Task(header, client_id, payload)
        self._running[task.task_id] = task
        self._task_contributors[task.task_id] = self._contributor(client_id)
        loop = asyncio.get_running_loop()
        self._deadlines[task.task_id] = loop.time() + parts.config.round_timeout_s
        parts.book.issue(task, self.owner)

    def _fit_config(self, server_round: int) -> Any:
        """The strategy's fit config for tasks on the model of ``server_round - 1``
        (asked once per version)."""
        cached = self._config_cache
        if cached is None or cached[0] != server_round:
            parts = self.parts
            plan = parts.strategy.configure_fit(server_round, parts.model.weights,
                                                parts.fleet.registry.infos())
            cached = self._config_cache = (server_round, plan.config)
        return cached[1]


class AsyncFitTasks:
    """The task owner (`fedloom.server.tasks.TaskOwner`) of the asynchronous fit tasks."""

    def __init__(self, driver: AsyncRounds) -> None:
        self.driver = driver

    @property
    def accepting(self) -> bool:
        return not self.driver.done

    async def take(self, client: ClientRecord, task: Task, header: ResultHeader,
                   fingerprint: bytes) -> Upload | bool:
        return await self.driver.take(client, task, header, fingerprint)

    async def fold(self, upload: Upload, payload: SpooledWeights) -> None:
        await self.driver.fold(upload, payload)

    def abandoned(self, upload: Upload) -> None:
        self.driver.abandoned(upload)

    def failed(self, task: Task, message: str) -> None:
        self.driver.failed(task, message)

    def client_gone(self, task: Task, reason: str) -> None:
        self.driver.end(task, reason)

    def end_reason(self, task: Task) -> str:
        return self.driver.end_reason(task)

    def needless(self, task: Task, header: ResultHeader) -> bool:
        # After the last step the results still in flight are answered "not needed".
        return self.driver.done


def _outcomes(tasks: list[Task]) -> dict[str, int]:
    counts = {status.value: 0 for status in TaskStatus}
    for task in tasks:
        counts[task.status.value] += 1
    return counts
