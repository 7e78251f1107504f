"""One SecAgg+ round attempt over the Fleet protocol's mailboxes.

`SecureAttempt` wraps one `SecAggServer` (the pure state machine of
`fedloom.secagg`) and turns each stage into tasks that clients pull and answer
through the ordinary task stream and Report/Push calls: the key stages (advertise keys,
share keys), the consistency stage and unmask carry only their small stage messages;
masked input also carries the global weights and the fit config (a client downloads,
trains, masks and uploads in that one stage, so one client's upload overlaps the next
one's download as in a plain round). The masked input comes back as a chunked uint32
payload, spooled to disk and verified before it touches the sum.

Threads: the state machine is not thread-safe, and its heavy steps (folding a masked
input into the sum, the final unmasking) must not stall the event loop. So those run in
one single-thread executor, in the order submitted, and every touch of the machine holds
one lock. A small stage reply (keys, shares, a confirmation, revealed shares: a
signature or a few hashes to check) is taken on the event loop itself when the machine
is idle, and goes through the executor only when it is busy: that saves a thread hop
per reply, which on a loaded machine is most of a small stage's latency. A stage is
complete when no connected client still owes a reply (or, in unmask, as soon as every
secret has t shares); `complete` is then set.

Memory: the sum is one uint32 vector, accumulated modulo 2**32 as each masked input
arrives (read through a memory map of its spool file, which is then deleted), so the
server's memory does not grow with the number of clients.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import secrets
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np

from fedloom._text import one_line
from fedloom.config import ServerConfig
from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.messages import MaskedInputHeader, ResultHeader, TaskHeader
from fedloom.payload import PayloadInfo
from fedloom.secagg import (
    STAGE_OF,
    KeyOffer,
    MaskedInputReply,
    MaskedInputRequest,
    PeerVerifier,
    RoundSetup,
    SecAggReply,
    SecAggRequest,
    SecAggServer,
    SecAggStatus,
    Stage,
    accused_dealer,
)
from fedloom.secagg._unmask import MapFn
from fedloom.server.registry import ClientRecord
from fedloom.server.tasks import EMPTY_PAYLOAD, Task, TaskBook, TaskStatus
from fedloom.server.uploads import Spool, SpooledWeights, Upload
from fedloom.types import Config, TaskKind

log = logging.getLogger("fedloom.server")

_R = TypeVar("_R")
EMPTY_INFO = PayloadInfo((), 0, hashlib.sha256(b"").digest())


class StageTask(Task):
    """A stage task of a secure round (a `Task` that knows its stage)."""

    def __init__(self, header: TaskHeader, client_id: str, payload: memoryview,
                 stage: Stage) -> None:
        super().__init__(header, client_id, payload)
        self.stage = stage


def stage_deadline_s(config: ServerConfig, stage: Stage) -> float:
    """How long a stage waits for its replies: the masked-input stage, where clients
    download, train and upload, has the round's deadline; the others the stage one."""
    if stage is Stage.MASKED_INPUT:
        return config.round_timeout_s
    return config.secure_aggregation.stage_timeout_s


def _stage(task: Task) -> Stage:
    """The stage of a task this attempt issued (the book hands an owner only its own)."""
    assert isinstance(task, StageTask)
    return task.stage


def _reject(reason: RejectReason, message: str) -> MessageRejectedError:
    return MessageRejectedError(reason, message)


class SecureAttempt:
    """The tasks and the state machine of one round attempt (see the module docstring).

    Args:
        setup: the attempt's public parameters (participants, k, t, ...).
        config: the server's settings (deadlines, chunk size, run id).
        payload, payload_info: the global weights the masked-input stage carries.
        fit_config: the fit config the masked-input stage carries.
        executor: a single-thread executor; every state-machine call runs there.
        book: the server's task book; stage tasks are issued and closed there.
        spool_dir: where masked inputs are spooled while they arrive.
        unmask_map: runs the final unmasking's ranges (a thread pool's ``map``).
        offers: participants' unused key offers, used by this attempt (see
            `fedloom.secagg.SecAggServer`; unauthenticated attempts only).
        verifier: the client CA (authenticated attempts): the server checks every
            certificate and signature a client sends before its neighbours see it.
    """

    def __init__(
        self,
        setup: RoundSetup,
        config: ServerConfig,
        payload: memoryview,
        payload_info: PayloadInfo,
        fit_config: Config,
        executor: concurrent.futures.ThreadPoolExecutor,
        book: TaskBook,
        spool_dir: Any,
        unmask_map: MapFn = map,
        offers: dict[str, KeyOffer] | None = None,
        verifier: PeerVerifier | None = None,
    ) -> None:
        self.setup = setup
        self.machine = SecAggServer(setup, offers=offers, verifier=verifier, map_fn=unmask_map)
        self.complete = asyncio.Event()
        self.tasks: dict[str, StageTask] = {}  # task id -> task, every stage
        self._config = config
        self._payload, self._payload_info = payload, payload_info
        self._fit_config = fit_config
        self._executor = executor
        self._book = book
        self._ended = False  # the attempt is over: no result is taken any more
        self._dropped: set[str] = set()
        #: dealers named by a neighbour that refused their share (left out of a retry)
        self.accused: set[str] = set()
        #: survivors that refused to confirm the survivor set (sat out of later rounds)
        self.withheld: set[str] = set()
        self._spool_dir = spool_dir
        self._loop = asyncio.get_running_loop()
        self._open: dict[str, StageTask] = {}  # client id -> its task of the open stage
        self._stage: Stage | None = None
        self._lock = threading.Lock()  # held by every touch of the machine

    # -- running the stages (called by the round driver) --------------------------------
    async def call(self, fn: Callable[..., _R], *args: Any) -> _R:
        """Run ``fn(*args)`` in the state machine's thread, holding the machine's lock."""
        return await self._loop.run_in_executor(self._executor, self._locked, fn, *args)

    def _locked(self, fn: Callable[..., _R], *args: Any) -> _R:
        with self._lock:
            return fn(*args)

    async def open_stage(self) -> Stage:
        """Issue the first stage's request to every client that owes one."""
        return self._issue(*await self.call(self._opening))

    async def advance(self) -> Stage | None:
        """Close the stage in the state machine and issue the next stage's requests, in
        one hop to its thread (the last stage unmasks there); the next stage, or None
        when the attempt has finished.

        Raises:
            SecureAggregationError: the attempt cannot go on (the machine has FAILED).
        """
        opened = await self.call(self._advance_and_open)
        return None if opened is None else self._issue(*opened)

    def _opening(self) -> tuple[Stage, dict[str, SecAggRequest], bool]:
        """(In the machine's thread.) The open stage, its requests, whether it is done."""
        machine = self.machine
        requests = {cid: machine.request_for(cid) for cid in machine.pending()}
        return machine.stage, requests, self._is_complete()

    def _advance_and_open(self) -> tuple[Stage, dict[str, SecAggRequest], bool] | None:
        self.machine.advance()
        if self.machine.status is not SecAggStatus.RUNNING:
            return None
        return self._opening()

    def _issue(self, stage: Stage, requests: Mapping[str, SecAggRequest],
               complete: bool) -> Stage:
        self._stage, self._open = stage, {}
        self.complete.clear()
        timeout = stage_deadline_s(self._config, stage)
        for client_id, request in sorted(requests.items()):
            trains = isinstance(request, MaskedInputRequest)  # weights and fit config
            header = TaskHeader(
                task_id=secrets.token_hex(16),
                run_id=self.setup.round_id.run_id,
                round=self.setup.round_id.server_round,
                kind=TaskKind.SECAGG,
                config=self._fit_config if trains else {},
                deadline_s=timeout,
                weights=self._payload_info if trains else EMPTY_INFO,
                secagg=request,
            )
            task = StageTask(header, client_id, self._payload if trains else EMPTY_PAYLOAD,
                             stage)
            self.tasks[task.task_id] = task
            self._open[client_id] = task
            self._book.issue(task, self)
        if complete:
            self.complete.set()
        return stage

    def close_stage(self, end: bool = False) -> None:
        """No more replies for this stage: unanswered tasks fail (their clients drop).
        ``end``: the attempt is over; nothing more is taken."""
        for task in self._open.values():
            if task.status is TaskStatus.PENDING:
                task.settle(TaskStatus.FAILED)
        self._book.close(self._open.values(), quiet=self._stage is Stage.UNMASK)
        self._open = {}
        self._ended = self._ended or end

    def _is_complete(self) -> bool:
        machine = self.machine
        if machine.status is not SecAggStatus.RUNNING:
            return True
        return machine.stage_complete or (machine.stage is Stage.UNMASK and machine.can_finish())

    # -- the task owner (`fedloom.server.tasks.TaskOwner`) ----------------------------
    @property
    def accepting(self) -> bool:
        return not self._ended

    def drop(self, client_id: str, reason: str) -> None:
        """A client vanished (left, went silent, its stream broke), or failed a stage:
        stop waiting for it. Idempotent."""
        if client_id not in self.setup.participants or client_id in self._dropped:
            return
        self._dropped.add(client_id)
        task = self._open.get(client_id)
        if task is not None and task.status is TaskStatus.PENDING and not task.in_flight:
            task.settle(TaskStatus.FAILED)
        log.info("secure round %s: client %s dropped (%s)", self.setup.round_id,
                 self._who(client_id), reason)
        future = self._executor.submit(self._locked, self._drop_and_check, client_id)
        future.add_done_callback(self._report)

    def _drop_and_check(self, client_id: str) -> None:
        self.machine.drop(client_id)
        if self._is_complete():
            self._loop.call_soon_threadsafe(self.complete.set)

    @staticmethod
    def _report(future: concurrent.futures.Future[None]) -> None:
        if future.exception() is not None:
            log.error("secure aggregation: dropping a client failed: %s", future.exception())

    def client_gone(self, task: Task, reason: str) -> None:
        self.drop(task.client_id, reason)

    def failed(self, task: Task, message: str) -> None:
        stage = _stage(task)
        log.warning("client %s failed secure stage %s: %s", self._who(task.client_id), stage,
                    message)
        if stage is Stage.CONSISTENCY:  # refused the survivor set an honest server sent
            self.withheld.add(task.client_id)
        dealer = accused_dealer(message) if stage is Stage.MASKED_INPUT else None
        if dealer is not None and dealer in self.machine.graph.get(task.client_id, ()):
            # Unproven (the share cannot be shown without revealing it), so no strike; but
            # a retry leaves the accused out, as it leaves out the accuser (who refused):
            # a dealer of bad shares cannot sink attempt after attempt, and a false
            # accusation costs its maker its own seat.
            self.accused.add(dealer)
            log.warning("secure round %s: client %s accuses client %s of dealing a share "
                        "that does not open or match its commitment", self.setup.round_id,
                        self._who(task.client_id), self._who(dealer))
        self.drop(task.client_id, f"client failure in {stage}")

    def _who(self, client_id: str) -> str:
        """A participant as the log names it: its identity (a certificate's name, or the
        name it joined with; escaped) and its session id."""
        if client_id not in self.setup.participants:
            return client_id
        return f"{one_line(self.setup.identity_of(client_id), 80)} ({client_id})"

    def end_reason(self, task: Task) -> str:
        stage = _stage(task)
        return (f"secure round {self.setup.round_id.server_round}: stage {stage} has closed "
                "for this client")

    def needless(self, task: Task, header: ResultHeader) -> bool:
        # Unmask closes once every secret has t shares: later shares are not needed.
        return _stage(task) is Stage.UNMASK and header.kind is TaskKind.SECAGG

    async def take(self, client: ClientRecord, task: Task, header: ResultHeader,
                   fingerprint: bytes) -> Upload | bool:
        """A fresh stage result: a masked input returns the `Upload` its chunks go to;
        any other stage's reply is taken now."""
        assert isinstance(task, StageTask)
        try:
            return await self._take(task, header, fingerprint)
        except MessageRejectedError as exc:
            self.drop(task.client_id, f"{task.stage} refused: {exc}")
            raise

    async def _take(self, task: StageTask, header: ResultHeader, fingerprint: bytes
                    ) -> Upload | bool:
        reply = header.secagg
        if reply is None:
            raise _reject(RejectReason.INVALID, f"a {header.kind} result for a secagg task")
        stage = Stage.MASKED_INPUT if isinstance(reply, MaskedInputHeader) else STAGE_OF[
            type(reply)]
        if stage is not task.stage:
            raise _reject(RejectReason.INVALID, f"a {stage} reply to a {task.stage} task")
        if isinstance(reply, MaskedInputHeader):
            spool = self._begin_masked_input(task, reply, header.update)
            return Upload(task, header, spool, fingerprint)
        if self._lock.acquire(blocking=False):  # the machine is idle: take it here
            try:
                complete = self._receive(task.client_id, reply, None)
            finally:
                self._lock.release()
        else:  # a fold or a stage change is under way: wait for it in its thread
            complete = await self.call(self._receive, task.client_id, reply, None)
        if task.status is TaskStatus.PENDING:  # the stage may have closed while it waited
            task.settle(TaskStatus.ACCEPTED, fingerprint)
        if complete:
            self.complete.set()
        return False

    def _begin_masked_input(self, task: StageTask, reply: MaskedInputHeader,
                            update: PayloadInfo | None) -> Spool:
        if reply.round_id != self.setup.round_id:
            raise _reject(RejectReason.STALE, f"a masked input for {reply.round_id}; this round "
                          f"attempt is {self.setup.round_id}")
        if reply.client_id != task.client_id:
            raise _reject(RejectReason.FORBIDDEN, "a masked input in another client's name")
        length = self.setup.masked_length
        assert update is not None  # the codec guarantees one uint32 vector
        if update.specs[0].shape != (length,):
            raise _reject(RejectReason.INVALID, f"a masked input is uint32[{length}], got "
                          f"uint32{list(update.specs[0].shape)}")
        if task.in_flight:
            raise _reject(RejectReason.CONFLICT, "an upload for this task is already in progress")
        return Spool(self._spool_dir, update, self._config.transfer.chunk_size)

    async def fold(self, upload: Upload, payload: SpooledWeights) -> None:
        """Fold a whole, verified masked input into the sum."""
        task, spool = upload.task, upload.spool
        try:
            if task.status is not TaskStatus.PENDING or self._ended:
                raise _reject(RejectReason.STALE, self.end_reason(task))
            masked = np.memmap(spool.path, dtype="<u4", mode="r",
                               shape=(self.setup.masked_length,))
            reply = MaskedInputReply(self.setup.round_id, task.client_id, masked)
            assert upload.header.update is not None  # its SHA-256 was verified chunk by chunk
            try:
                complete = await self.call(self._receive, task.client_id, reply,
                                           upload.header.update.sha256)
            finally:
                del reply, masked
        except MessageRejectedError as exc:
            self.drop(task.client_id, f"masked input refused: {exc}")
            raise
        finally:
            spool.discard()
        if task.status is TaskStatus.PENDING:  # the stage may have closed while it folded
            task.settle(TaskStatus.ACCEPTED, upload.fingerprint)
        if complete:
            self.complete.set()

    def abandoned(self, upload: Upload) -> None:
        """The upload broke off; the client may push again while the stage is open."""

    def _receive(self, client_id: str, reply: SecAggReply, digest: bytes | None) -> bool:
        """(In the machine's thread.) Take a reply; whether the stage is now complete
        (one hop to the thread instead of two)."""
        self.machine.receive(client_id, reply, digest=digest)
        return self._is_complete()

    # -- progress ---------------------------------------------------------------------
    def fit_outcomes(self) -> dict[str, int]:
        """How the masked-input tasks (the attempt's fits) ended, by status."""
        counts = {status.value: 0 for status in TaskStatus}
        for task in self.tasks.values():
            if task.stage is Stage.MASKED_INPUT:
                counts[task.status.value] += 1
        return counts

    def counts(self) -> tuple[int, int]:
        """(answered, issued) tasks of the open stage: answered is the replies taken (a
        client that dropped or failed the stage did not answer)."""
        answered = sum(1 for t in self._open.values() if t.status is TaskStatus.ACCEPTED)
        return answered, len(self._open)
