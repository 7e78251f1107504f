"""The task book: every task the server hands a client, of every kind, in one place.

A round driver *issues* tasks (plain fit and evaluate phases, the stages of a secure
round, ...), each with an *owner* that handles its results. The book *offers* a client
its pending task, *answers* a result header: it finds the task (open, or closed a little
while ago), checks the sender, the round and retries (one fingerprint for every kind of
result, so a Push retried after a lost acknowledgement is answered "duplicate"), and
passes a fresh result to the task's owner. When an owner is done with its tasks it
*closes* them: the book remembers how each ended, so a late result hears why ("round 3
closed: enough results arrived") rather than "unknown task".

A task's status changes in one place, `Task.settle`, from pending, once.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.messages import ResultHeader, TaskHeader

if TYPE_CHECKING:
    from fedloom.server.registry import ClientRecord
    from fedloom.server.uploads import SpooledWeights, Upload

EMPTY_PAYLOAD = memoryview(b"")


class TaskStatus(enum.StrEnum):
    PENDING = "pending"
    ACCEPTED = "accepted"
    FAILED = "failed"
    CANCELLED = "cancelled"  # the round closed with enough results (over-selection)


@dataclasses.dataclass(eq=False)
class Task:
    """A task sent (or to be sent) to one client, and what became of it."""

    header: TaskHeader
    client_id: str
    payload: memoryview
    status: TaskStatus = TaskStatus.PENDING
    #: Identifies the accepted result (`result_fingerprint`), for idempotent retries.
    result_fingerprint: bytes = b""
    in_flight: bool = False  # an upload for this task is being received
    owner: TaskOwner | None = None  # set by `TaskBook.issue`

    @property
    def task_id(self) -> str:
        return self.header.task_id

    def settle(self, status: TaskStatus, fingerprint: bytes = b"") -> None:
        """End the task (the only place its status changes): from pending, once."""
        if self.status is not TaskStatus.PENDING:
            raise RuntimeError(f"task {self.task_id} has already ended ({self.status})")
        if status is TaskStatus.PENDING:
            raise ValueError("a task settles to an end status")
        self.status = status
        self.result_fingerprint = fingerprint


class TaskOwner(Protocol):
    """What issued a task and handles its results: a round phase, a secure attempt."""

    @property
    def accepting(self) -> bool:
        """Whether its pending tasks are still offered and their results taken."""

    async def take(self, client: ClientRecord, task: Task, header: ResultHeader,
                   fingerprint: bytes) -> Upload | bool:
        """A fresh result for ``task``: an `Upload` its payload must follow, or False
        (taken whole). Raises `MessageRejectedError` for a result it refuses."""

    async def fold(self, upload: Upload, payload: SpooledWeights) -> None:
        """Fold a whole, verified upload into the round."""

    def abandoned(self, upload: Upload) -> None:
        """An upload broke off (the client may push again)."""

    def failed(self, task: Task, message: str) -> None:
        """The client reported that it could not do ``task``."""

    def client_gone(self, task: Task, reason: str) -> None:
        """The client holding pending ``task`` (no upload under way) has gone."""

    def end_reason(self, task: Task) -> str:
        """Why ``task`` ended without an accepted result (told to a late result)."""

    def needless(self, task: Task, header: ResultHeader) -> bool:
        """True when a late result is simply no longer needed (answered, not refused)."""


def result_fingerprint(header: ResultHeader) -> bytes:
    """One digest of everything a result says, for every kind of task: a retry of the
    same result matches, a different result for the same task does not."""
    sha = header.update.sha256 if header.update is not None else b""
    parts = (header.kind, header.num_examples, header.base_round, header.loss,
             sorted(header.metrics.items()), sha, header.secagg, header.codec)
    return hashlib.sha256(repr(parts).encode()).digest()


@dataclasses.dataclass(frozen=True, slots=True)
class ClosedTask:
    """How a closed task ended, kept for results that arrive after it closed."""

    client_id: str
    status: TaskStatus
    fingerprint: bytes
    reason: str  # why it ended without an accepted result
    quiet: bool  # a late result is answered "not needed" rather than refused


#: Closings (phases, stages, asynchronous versions) whose tasks' ends are remembered, so
#: a late result hears why its task ended: an asynchronous run closes one a version, and
#: a slow client's result may come many versions later.
KEEP_CLOSINGS = 64


class TaskBook:
    """The server's tasks: issue, offer, answer, close. Lives on the event loop.

    Args:
        wake: wakes a client's long-poll or task stream (it has a new task).
        keep_closings: how many closings (phases, stages) to remember for late results.
    """

    def __init__(self, wake: Callable[[str], None], keep_closings: int = KEEP_CLOSINGS) -> None:
        self._wake = wake
        self._open: dict[str, Task] = {}  # task id -> task, until its owner closes it
        self._latest: dict[str, Task] = {}  # client id -> its most recently issued task
        # client id -> the task it was handed and has not answered: it is working on it,
        # even once the task has ended server-side (a stale asynchronous task, a round
        # that closed), and gets no other until it answers or goes
        self._working: dict[str, str] = {}
        self._closed: collections.deque[dict[str, ClosedTask]] = collections.deque(
            maxlen=keep_closings)

    def issue(self, task: Task, owner: TaskOwner) -> None:
        """Hand ``task`` to its client (it is offered until answered or closed)."""
        task.owner = owner
        self._open[task.task_id] = task
        self._latest[task.client_id] = task
        self._wake(task.client_id)

    def offer(self, client_id: str, sent: str | None = None) -> Task | None:
        """The client's pending task, unless it is ``sent`` (a task stream sent it
        already: the client is working on it)."""
        task = self._latest.get(client_id)
        if (task is None or task.status is not TaskStatus.PENDING or task.task_id == sent
                or task.owner is None or not task.owner.accepting):
            return None
        self._working[client_id] = task.task_id
        return task

    def pending(self, client_id: str) -> Task | None:
        """The client's pending task with no upload under way, if any."""
        task = self._latest.get(client_id)
        if task is None or task.status is not TaskStatus.PENDING or task.in_flight:
            return None
        return task

    def busy(self, client_id: str) -> bool:
        """Whether the client holds a pending task (offered, or answered in part), or
        is still working on one it was handed that has ended since (it has not
        answered it: a new task would only wait behind the old one's fit)."""
        task = self._latest.get(client_id)
        return (task is not None and task.status is TaskStatus.PENDING) or (
            client_id in self._working)

    def client_gone(self, client_id: str, reason: str) -> None:
        """A client left (or went silent): its pending task ends now, not at a deadline."""
        self._working.pop(client_id, None)
        task = self.pending(client_id)
        if task is not None and task.owner is not None:
            task.owner.client_gone(task, reason)

    async def answer(self, client: ClientRecord, header: ResultHeader) -> Upload | bool:
        """Check a result header against its task and pass it to the task's owner.

        Returns an `Upload` when a payload must follow, else whether it was a duplicate
        (a retry of an accepted result). Raises `MessageRejectedError` otherwise.
        """
        if self._working.get(client.client_id) == header.task_id:
            del self._working[client.client_id]  # it answered: done with that task
        task = self._open.get(header.task_id)
        if task is None:
            return self._closed_answer(client.client_id, header)
        owner = task.owner
        assert owner is not None
        if task.client_id != client.client_id:
            raise MessageRejectedError(
                RejectReason.FORBIDDEN, "that task was issued to another client")
        if header.round != task.header.round:
            raise MessageRejectedError(
                RejectReason.STALE,
                f"result names round {header.round}, the task is for round {task.header.round}")
        fingerprint = result_fingerprint(header)
        if task.status is TaskStatus.ACCEPTED:
            return _retried(fingerprint, task.result_fingerprint)
        if task.status is not TaskStatus.PENDING or not owner.accepting:
            if owner.needless(task, header):
                return False
            raise MessageRejectedError(RejectReason.STALE, owner.end_reason(task))
        if header.kind is None:
            owner.failed(task, header.failure[:200])
            return False
        if header.kind is not task.header.kind:
            raise MessageRejectedError(
                RejectReason.INVALID, f"a {header.kind} result was sent for a "
                f"{task.header.kind} task")
        return await owner.take(client, task, header, fingerprint)

    def _closed_answer(self, client_id: str, header: ResultHeader) -> bool:
        for closing in reversed(self._closed):
            ended = closing.get(header.task_id)
            if ended is None or ended.client_id != client_id:
                continue
            if ended.status is TaskStatus.ACCEPTED:
                return _retried(result_fingerprint(header), ended.fingerprint)
            if ended.quiet:
                return False
            raise MessageRejectedError(
                RejectReason.STALE, f"{ended.reason}; this result is no longer needed")
        raise MessageRejectedError(
            RejectReason.STALE,
            f"task {header.task_id[:40]!r} is not open (unknown, or its round has closed)")

    def close(self, tasks: Iterable[Task], quiet: bool = False) -> None:
        """The owner is done with ``tasks`` (settled): drop them and their payloads, and
        remember how each ended. ``quiet``: late results are not needed, not refused."""
        closing: dict[str, ClosedTask] = {}
        for task in tasks:
            self._open.pop(task.task_id, None)
            if self._latest.get(task.client_id) is task:
                del self._latest[task.client_id]
            task.payload = EMPTY_PAYLOAD  # a closed task is never sent: drop the model
            reason = "" if task.owner is None else task.owner.end_reason(task)
            closing[task.task_id] = ClosedTask(task.client_id, task.status,
                                               task.result_fingerprint, reason, quiet)
        if closing:
            self._closed.append(closing)


def _retried(fingerprint: bytes, accepted: bytes) -> bool:
    if fingerprint == accepted:
        return True  # an idempotent retry after a lost acknowledgement
    raise MessageRejectedError(
        RejectReason.CONFLICT, "a different result was already accepted for this task")
