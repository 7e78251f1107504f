"""One round's open tasks and the results that have come back.

A `RoundTasks` tracks the tasks issued for one phase (fit or evaluate) of a round, who
has answered, and when the phase may close: as soon as every sampled client has
answered (a result, a reported failure, or leaving), as soon as ``target`` results
were accepted (over-selection, see `fedloom.server.stragglers`: the tasks still open are
then cancelled), or at the deadline with at least the minimum. Fit updates are handed to
the strategy, running in a worker thread, through a thread-safe queue as they arrive (the
aggregate is computed as a stream).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from fedloom.errors import RoundAbortedError
from fedloom.server.crashpoints import crashpoint
from fedloom.server.tasks import Task, TaskStatus
from fedloom.types import ClientUpdate, EvaluateResult, TaskKind

log = logging.getLogger("fedloom.server")
_R = TypeVar("_R")

#: The task of a round phase (the name the phase's callers know it by).
IssuedTask = Task


class _End:
    pass


@dataclasses.dataclass(frozen=True)
class _Abort:
    reason: str


_UpdateItem = ClientUpdate | _End | _Abort


def end_stream(source: queue.Queue[_UpdateItem], abort_reason: str | None = None) -> None:
    """End the update stream of ``source``: its reader returns, or raises
    `RoundAbortedError` with ``abort_reason``."""
    source.put(_End() if abort_reason is None else _Abort(abort_reason))


class Aggregation(Generic[_R]):
    r"""A round's aggregation (``fn(*args)``, reading the round's update stream) in the
    aggregation thread; ``result`` is what the round awaits.

    A round cancelled mid-fit (the server is stopping) ends its update stream and then
    `abandon`\ s its aggregation: nobody will await ``result`` any more.
    """

    def __init__(self, executor: concurrent.futures.Executor, fn: Callable[..., _R],
                 *args: Any) -> None:
        self._job = executor.submit(fn, *args)
        self.result: asyncio.Future[_R] = asyncio.wrap_future(self._job)

    def abandon(self) -> None:
        """Let go of ``result``, once the update stream has been ended.

        ``result`` is cancelled, so the `RoundAbortedError` the thread raises on its way
        out never reaches it: an exception set on a future nobody reads is logged as
        "Future exception was never retrieved" when the future is collected (and a done
        callback cannot retrieve it if the loop stops before running the callback). The
        thread itself is released by the ended stream, not by the cancel; any other
        error it ends with is a fault worth one line.
        """
        self.result.cancel()
        self._job.add_done_callback(_report_abandoned)


def _report_abandoned(job: concurrent.futures.Future[Any]) -> None:
    error = None if job.cancelled() else job.exception()
    if error is not None and not isinstance(error, RoundAbortedError):
        log.warning("an abandoned round's aggregation failed: %s: %s",
                    type(error).__name__, error)


def updates_from_queue(source: queue.Queue[_UpdateItem]) -> Iterator[ClientUpdate]:
    """Yield updates until the round closes; raise `RoundAbortedError` if it fails."""
    while True:
        item = source.get()
        if isinstance(item, _End):
            return
        if isinstance(item, _Abort):
            raise RoundAbortedError(item.reason)
        yield item
        crashpoint("mid_aggregation")


class RoundTasks:
    """The open phase of a round. Lives on the event loop.

    A task's status changes only through these methods, which keep the counts behind
    `num_accepted` and `num_answered` (read on every result: O(1), not a scan).
    """

    def __init__(
        self, server_round: int, kind: TaskKind, minimum: int, target: int | None = None
    ) -> None:
        self.round = server_round
        self.kind = kind
        self.minimum = minimum
        self.target = target  # accepted results that close the phase early (None: all)
        self.tasks: dict[str, IssuedTask] = {}
        self.by_client: dict[str, IssuedTask] = {}
        self.updates: queue.Queue[_UpdateItem] = queue.Queue()
        self.evaluations: list[EvaluateResult] = []
        self.failures: dict[str, str] = {}
        self.num_cancelled = 0
        self.closed = False
        self._accepted = 0
        self._answered = 0
        self._all_answered = asyncio.Event()

    def add(self, task: IssuedTask) -> None:
        self.tasks[task.task_id] = task
        self.by_client[task.client_id] = task

    @property
    def num_accepted(self) -> int:
        return self._accepted

    @property
    def num_answered(self) -> int:
        return self._answered

    def outcomes(self) -> dict[str, int]:
        """How many tasks ended in each status (``pending`` until the phase closes)."""
        counts = {status.value: 0 for status in TaskStatus}
        for task in self.tasks.values():
            counts[task.status.value] += 1
        return counts

    def _settle(self, task: IssuedTask, status: TaskStatus, fingerprint: bytes = b"") -> None:
        task.settle(status, fingerprint)
        self._answered += 1
        if status is TaskStatus.ACCEPTED:
            self._accepted += 1

    def accept_update(self, task: IssuedTask, update: ClientUpdate, fingerprint: bytes) -> None:
        self._settle(task, TaskStatus.ACCEPTED, fingerprint)
        self.updates.put(update)
        self._check_answered()

    def accept_evaluation(
        self, task: IssuedTask, result: EvaluateResult, fingerprint: bytes
    ) -> None:
        self._settle(task, TaskStatus.ACCEPTED, fingerprint)
        self.evaluations.append(result)
        self._check_answered()

    def fail(self, task: IssuedTask, reason: str) -> None:
        if task.status is TaskStatus.PENDING:
            self._settle(task, TaskStatus.FAILED)
            self.failures[task.client_id] = reason
            self._check_answered()

    def _check_answered(self) -> None:
        if self._target_reached():
            self.closed = True  # now, not when `wait` wakes: no result beyond the target
        if self.num_answered == len(self.tasks) or self.closed:
            self._all_answered.set()

    def _target_reached(self) -> bool:
        return self.target is not None and self.num_accepted >= self.target

    def end_reason(self, task: IssuedTask) -> str:
        """Why ``task`` ended without an accepted result (for late results)."""
        if task.status is TaskStatus.CANCELLED or (
            task.status is TaskStatus.PENDING and self._target_reached()
        ):
            return f"enough results arrived ({self.num_accepted} of {len(self.tasks)} tasks)"
        return self.failures.get(task.client_id, "its deadline has passed")

    def abort(self, reason: str) -> None:
        """End the fit stream now (the server is stopping); the aggregation thread exits."""
        self.closed = True
        if self.kind is TaskKind.FIT:
            self.updates.put(_Abort(reason))

    async def wait(self, timeout_s: float) -> bool:
        """Wait until all answered or the deadline; True when enough results came back."""
        if self.tasks:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._all_answered.wait()
        self.closed = True
        cancel = self._target_reached()
        for task in self.tasks.values():
            if task.status is not TaskStatus.PENDING:
                continue
            if cancel:
                self._settle(task, TaskStatus.CANCELLED)
                self.num_cancelled += 1
            else:
                self._settle(task, TaskStatus.FAILED)
                self.failures.setdefault(task.client_id, "no result before the deadline")
        enough = self.num_accepted >= self.minimum and self.num_accepted > 0
        if self.kind is TaskKind.FIT:
            self.updates.put(
                _End()
                if enough
                else _Abort(
                    f"{self.num_accepted} of {len(self.tasks)} sampled clients returned an "
                    f"update; at least {self.minimum} needed"
                )
            )
        return enough
