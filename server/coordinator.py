"""The coordinator: one run's parts, put together, and the face the servicer talks to.
Knows nothing of gRPC.

- `fedloom.server.fleet`: who is connected (Join, heartbeats, Leave, quarantine);
- `fedloom.server.tasks`: the task book (every task of every kind: offer, answer, close);
- `fedloom.server.round_loop`: the rounds, each run by a round driver
  (`fedloom.server.driver`: plain, or SecAgg+ under ``[secure_aggregation] enabled``);
- `fedloom.server.model`: the global model and its broadcast payload.

The servicer calls `join`, `heartbeat`, `leave`, `stream_closed`, `pull` and
`accept_result` (then feeds the returned `Upload`); each validates its input and raises
`MessageRejectedError` with a reason. The server calls `run`, then `linger`: a run that
is over stays answerable ("run finished") a while, so that its clients learn it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib

from fedloom.config import ServerConfig
from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.messages import JoinReply, JoinRequest, NoTask, ResultHeader, TaskHeader
from fedloom.records import RoundRecord
from fedloom.server.driver import RoundParts
from fedloom.server.evaluation import EvaluateFn
from fedloom.server.fleet import Fleet
from fedloom.server.model import GlobalModel
from fedloom.server.persistence import RunPersistence
from fedloom.server.progress import RoundReporter
from fedloom.server.registry import ClientRecord
from fedloom.server.round_loop import RoundLoop, round_driver
from fedloom.server.tasks import TaskBook
from fedloom.server.uploads import Upload
from fedloom.strategies import Strategy
from fedloom.weights import Weights

__all__ = ["Coordinator", "EvaluateFn"]


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
        self.run_id = persistence.run_id
        reporter = reporter or RoundReporter(enabled=False)
        self.fleet = Fleet(config, self.run_id, reporter)
        self.registry = self.fleet.registry
        self.quarantine = self.fleet.quarantine
        self.book = TaskBook(self.fleet.wake)
        self.model = GlobalModel(persistence)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aggregate")
        parts = RoundParts(config, self.run_id, strategy, self.fleet, self.book, self.model,
                           self._executor, persistence.state_dir / "spool" / self.run_id,
                           reporter)
        self.driver = round_driver(parts, persistence)
        self.fleet.on_departure(self.book.client_gone)
        self.fleet.on_departure(self.driver.client_gone)
        self.rounds = RoundLoop(parts, self.driver, persistence, evaluate_fn)
        self.finished = asyncio.Event()  # set only once the run is over and recorded
        self.stopping = False  # run() has ended, finished or not (e.g. the server stops)
        # Found over at start (a restart after the last commit, or of a finished run):
        # its clients are unknown here, but at least the last round's were out there.
        self.found_over = self.rounds.over
        last = self.history[-1].num_sampled if self.history else 0
        self._expected = max(config.min_clients, last) if self.found_over else 0
        self._told: set[str] = set()  # names of clients told "run finished" (bounded)

    # -- what the run has done ------------------------------------------------------
    @property
    def history(self) -> list[RoundRecord]:
        return self.rounds.history

    @property
    def next_round(self) -> int:
        return self.rounds.next_round

    @property
    def stopped_reason(self) -> str:
        return self.rounds.stopped_reason

    @property
    def global_weights(self) -> Weights:
        return self.model.weights

    # -- client calls ---------------------------------------------------------------
    def join(self, request: JoinRequest, identity: str | None = None,
             peer: str = "") -> JoinReply:
        return self.fleet.join(request, identity, peer)

    def strike(self, record: ClientRecord, reason: RejectReason) -> None:
        self.fleet.strike(record, reason)

    def heartbeat(self, record: ClientRecord) -> None:
        self.fleet.heartbeat(record)

    def leave(self, record: ClientRecord, reason: str) -> None:
        self.fleet.leave(record, reason)

    def stream_closed(self, record: ClientRecord) -> None:
        self.fleet.stream_closed(record)

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
            task = self.book.offer(record.client_id, sent)
            if task is not None:
                return task.header, task.payload
            if self.finished.is_set():
                if len(self._told) < self._expected:
                    self._told.add(record.info.name)
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

    async def accept_result(self, record: ClientRecord, header: ResultHeader) -> Upload | bool:
        """A result header for any task: an `Upload` whose chunks must follow, or
        whether it was a duplicate (a retry of an accepted result)."""
        return await self.book.answer(record, header)

    # -- the run --------------------------------------------------------------------
    async def run(self) -> None:
        """Run rounds ``next_round..num_rounds``, then mark the run finished."""
        reaper = asyncio.create_task(self.fleet.reap(self.finished))
        try:
            await self.rounds.run()
            self.finished.set()
        finally:
            # A stop (cancel, signal) is not the end of the run: clients told "finished"
            # would leave for good and the restarted server would wait for them forever.
            self.stopping = True
            self.fleet.wake_all()
            reaper.cancel()
            self.driver.close()
            self._executor.shutdown(wait=False)

    async def linger(self) -> None:
        """The run is over: stay answerable ("run finished") a while, so that no client
        keeps retrying a server that is gone.

        A server that ran rounds knows its clients: it waits while any is connected
        (each hears it at its next poll and leaves), for at most ``long_poll_s`` (and
        5 s): a client still training a task it was given cannot be waited for long.
        One that found the run over when it started (`found_over`: a restart after the
        last commit, or of a finished run) knows none: it waits, for at most
        ``finished_grace_s``, until as many clients as the last round had have heard it
        and left. Silent sessions are reaped meanwhile.
        """
        config = self.config
        grace = config.finished_grace_s
        if not self.found_over:
            grace = min(grace, 5.0, config.long_poll_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        reaper = asyncio.create_task(self.fleet.reap(asyncio.Event()))
        try:
            while len(self.registry) or len(self._told) < self._expected:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self.registry.changed.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await self.registry.changed.wait()
        finally:
            reaper.cancel()
