"""`ParallelFitter`: a synchronous round's clients trained in worker processes.

A `fedloom.simulations.fitting.RoundFitter` for the local engine. ``workers`` processes
start once, each with one torch thread and its own copy of the `Job`; each builds the
clients it is asked for from the job (cached, sharing one model object per process)
and trains them as the serial local engine does (`fedloom.simulations.lean`). With
``train_here``, this process trains chunks too, between taking the workers' results.
A round sends every worker its weights, pickled once for all workers, then chunks of
tasks (`fedloom.simulations._parallel_worker` has the messages).

The round's tasks are cut into chunks of consecutive tasks that shrink as the round
goes on (`chunk_sizes`: large chunks first, for few messages; small ones last, so that
no process waits long at the round's end for another to finish), none holding more
than ``chunk_bytes`` of trained weights. A chunk goes to the worker with the fewest in
hand (at most `IN_FLIGHT`: one training, one waiting), so a worker slowed by other
work, or by larger shares, takes fewer. A worker sends each chunk back as one message,
its clients' weights as rows of one array per tensor, through a pipe widened to hold a
few small chunks; the engine reads the chunks in task order, and hands chunks out only
while those from the one it reads next on hold at most `IN_FLIGHT` chunk budgets per
training process: memory stays bounded by a few budgets. A small model's whole round
fits in them, so no process waits on the engine's reading; a large model's chunks hold
one client each.

Each client's `FitOutput` equals what its `TorchClient.fit` returns, bit for bit (the
same code on one thread); the round's aggregate differs from the serial engine's only
in the order of its float64 sums (a float32 ulp at most), and it is the same in every
run with the same number of workers and clients.

Failures: a client that raises gives a `RuntimeError` in its slot (its type, message
and, as ``__cause__``, the worker's traceback) and the round goes on. A worker that
dies gives each task of the chunks it held a `RuntimeError` naming its exit code and
clients; the round's other chunks go to the workers left, and a new worker replaces it
at the next `fit`.

Limits: each worker holds a whole copy of the job's data (and this process keeps the
pickled job, to start replacements); a worker that hangs (neither answers nor exits)
stalls the round, as a hanging client stalls the serial engine; a result reaches the
engine when its chunk is done. The script that creates the fitter must guard its entry
point with ``if __name__ == "__main__":`` (both start methods import it afresh in each
worker).

Speed: the workers take the fits; this process takes each chunk's deltas and weighted
sum a chunk at a time (`fedloom.stacked`), so its share per client is small, and a
round's fixed costs (sampling, the fit configs, the messages) stay serial. With
``train_here`` it fills its waits with chunks of its own. `benchmarks/simulation.py`
measures it beside the serial engine (the figures are in benchmarks/README.md).

Example::

    from fedloom.simulations.parallel import ParallelFitter

    with ParallelFitter(job, workers=4) as fitter:
        history = run_local(strategy, client_fn, initial, num_clients=100,
                            num_rounds=20, fitter=fitter)
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import pickle
import weakref
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import wait
from types import TracebackType
from typing import TYPE_CHECKING

from fedloom.client_sdk._client import FitOutput
from fedloom.errors import ConfigError
from fedloom.simulations._parallel_worker import Taken, Worker, outputs
from fedloom.simulations.fitting import FitTask
from fedloom.simulations.lean import (
    CHUNK_BYTES,
    LeanFitter,
    TrainedChunk,
    chunk_outputs,
    rows_within,
)
from fedloom.weights import Weights

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext

    from fedloom.simulations.job import Job

#: Start methods that give a worker a fresh interpreter. ``fork`` is refused: it copies
#: a parent that has imported torch, whose thread pools and locks do not survive it.
START_METHODS = ("spawn", "forkserver")
#: The smallest chunk (`chunk_sizes`) is a ``1 / TAIL_SHARE`` share of one training
#: process's part of a round.
TAIL_SHARE = 6
#: Chunks a worker holds at once: one training, one waiting in its pipe.
IN_FLIGHT = 2


def chunk_sizes(tasks: int, workers: int, rows: int) -> list[int]:
    """The sizes of a round's chunks, in task order, for ``workers`` training processes
    (this one included when it trains): each at most ``rows`` (the weights that fit in
    the chunk budget).

    Guided, by factoring (Hummel, Schonberg and Flynn, CACM 1992): each chunk takes
    ``1 / (2 * workers)`` of the tasks not yet chunked, so chunks shrink as the round
    goes on, down to a floor of ``tasks / (TAIL_SHARE * workers)``. The large
    chunks first keep the messages few; the small ones last keep short the time a
    process waits at the round's end for another to finish the chunks it holds.
    """
    floor = max(1, math.ceil(tasks / (TAIL_SHARE * workers)))
    sizes, left = [], tasks
    while left > 0:
        size = max(1, min(rows, left, max(floor, math.ceil(left / (2 * workers)))))
        sizes.append(size)
        left -= size
    return sizes


class _Schedule:
    """One round's chunks over the workers (and this process, when it trains too): a
    chunk goes to the worker with the fewest in flight (at most `IN_FLIGHT` each: one
    training, one waiting in its pipe); this process trains the next chunk itself
    whenever the one the engine reads next is not back yet; and chunks are handed out
    only while they hold at most ``window`` tasks from that one on (that one always),
    which bounds what waits here."""

    def __init__(self, workers: list[Worker], chunks: list[list[FitTask]], window: int,
                 local: Callable[[list[FitTask]], TrainedChunk] | None = None) -> None:
        self.workers, self.chunks, self.window, self.local = workers, chunks, window, local
        self.assigned = self.consumed = 0
        self.done: dict[int, Taken] = {}
        # tasks before each chunk (and, last, in all)
        self._offsets = list(itertools.accumulate((len(c) for c in chunks), initial=0))
        self._top_up()

    def _open(self, chunk: int) -> bool:
        """Whether ``chunk`` may be handed out now (within the window)."""
        if chunk >= len(self.chunks):
            return False
        ahead = self._offsets[chunk + 1] - self._offsets[self.consumed]
        return chunk == self.consumed or ahead <= self.window

    def next(self) -> tuple[list[FitTask], Taken]:
        """The next chunk in task order, with its result or why it has none."""
        chunk = self.consumed
        while chunk not in self.done:
            busy = [w for w in self.workers if w.pending]
            if self.local is not None:
                self._collect(busy, timeout=0.0)
                if chunk in self.done:
                    break
                if self._open(self.assigned):
                    mine = self.assigned
                    self.assigned += 1
                    self.done[mine] = Taken(mine, self.local(self.chunks[mine]))
                    continue
            if not busy:  # every worker left has exited: nobody can fit this chunk
                reasons = "; ".join(w.failure for w in self.workers if w.failure)
                clients = ", ".join(str(t.index) for t in self.chunks[chunk])
                self.done[chunk] = Taken(chunk, None, f"no worker left to fit clients "
                                                      f"{clients} ({reasons})")
                break
            self._collect(busy, timeout=None)
        self.consumed += 1
        self._top_up()
        return self.chunks[chunk], self.done.pop(chunk)

    def _collect(self, busy: list[Worker], timeout: float | None) -> None:
        """Take the chunks of the workers that are ready (waiting up to ``timeout``)."""
        if not busy:
            return
        ready = wait([x for w in busy for x in w.waitables], timeout=timeout)
        for worker in busy:
            if any(x in ready for x in worker.waitables):
                self.done.update((t.chunk, t) for t in worker.take())
        self._top_up()

    def _top_up(self) -> None:
        while self._open(self.assigned):
            idle = [w for w in self.workers if not w.exited and len(w.pending) < IN_FLIGHT]
            if not idle:
                return
            worker = min(idle, key=lambda w: (len(w.pending), w.number))
            worker.assign(self.assigned, self.chunks[self.assigned])
            self.assigned += 1


def _stop_all(workers: list[Worker]) -> None:
    for worker in workers:  # all at once, then wait for each
        worker.ask_to_stop()
    for worker in workers:
        worker.stop()


class ParallelFitter:
    """Fits a round's tasks in ``workers`` processes (see the module docstring).

    Args:
        job: the scenario's `Job`; pickled to each worker, which builds its clients
            with ``job.make_client(index, model=...)``.
        workers: worker processes, at least 1 (1 still isolates the fits from this
            process). More than the machine's cores only adds overhead.
        start_method: ``"spawn"`` (the default) or ``"forkserver"``.
        chunk_bytes: the most bytes of trained weights one chunk holds.
        train_here: this process trains chunks too, whenever the chunk the engine reads
            next is not back yet (``workers + 1`` processes train; `fedloom simulate`'s
            ``workers = N`` is ``ParallelFitter(job, N - 1, train_here=True)``). On a
            machine with as many cores as processes, the engine's own work then shares
            this process's core instead of taking time from a worker's.

    Raises:
        ConfigError: ``workers`` or ``chunk_bytes`` below 1, or another start method.
    """

    def __init__(self, job: Job, workers: int, *, start_method: str = "spawn",
                 chunk_bytes: int = CHUNK_BYTES, train_here: bool = False) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(
                "workers", f"must be an int of at least 1, got {workers!r}; for fits in "
                "this process use fedloom.simulations.fitting.SerialFitter",
            )
        if start_method not in START_METHODS:
            raise ConfigError(
                "start_method", f"{start_method!r} is not one of {', '.join(START_METHODS)} "
                "(fork copies a process that has imported torch, which can deadlock)",
            )
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ConfigError("chunk_bytes", f"must be an integer >= 1, got {chunk_bytes!r}")
        self.chunk_bytes = chunk_bytes
        self._job = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
        self._context: SpawnContext | ForkServerContext = (
            multiprocessing.get_context("spawn") if start_method == "spawn"
            else multiprocessing.get_context("forkserver")
        )
        self._workers = [Worker(n, self._job, self._context) for n in range(workers)]
        self._local = LeanFitter(job.client_fn()) if train_here else None
        self._round = 0
        # Runs once: at close(), or when the fitter is collected unclosed (the list is
        # the live one: replaced workers included).
        self._stop = weakref.finalize(self, _stop_all, self._workers)

    @property
    def workers(self) -> int:
        return len(self._workers)

    def fit(self, weights: Weights, tasks: Sequence[FitTask]) -> Iterator[FitOutput | Exception]:
        """Send the round to the workers now; iterate for the results, in task order.

        Each task's result is its client's `FitOutput`, or a `RuntimeError` for a client
        that raised or a worker that died. Consume one round's iterator before calling
        `fit` again: a new call finishes the unread results of the previous round and
        discards them, and the old iterator then raises.

        Raises:
            RuntimeError: the fitter is closed.
        """
        if not self._stop.alive:
            raise RuntimeError("this ParallelFitter is closed; create a new one to fit again")
        self._settle()
        self._round += 1
        blob = pickle.dumps(weights, protocol=pickle.HIGHEST_PROTOCOL)
        for worker in self._workers:
            worker.start_round(blob)
        count = len(self._workers) + (self._local is not None)
        rows = rows_within(self.chunk_bytes, weights)
        chunks, begin = [], 0
        for size in chunk_sizes(len(tasks), count, rows):
            chunks.append(list(tasks[begin:begin + size]))
            begin += size
        local = self._local
        # Up to IN_FLIGHT chunk budgets per training process handed out at once: a small
        # model's round fits in that whole, so no process waits on the window.
        window = IN_FLIGHT * count * rows
        schedule = _Schedule(list(self._workers), chunks, window, None if local is None
                             else lambda part: local.train_chunk(weights, part))
        return self._results(self._round, schedule, weights)

    def _results(self, round_id: int, schedule: _Schedule, weights: Weights
                 ) -> Iterator[FitOutput | Exception]:
        for _ in schedule.chunks:
            self._check_current(round_id)
            tasks, taken = schedule.next()
            if taken.message is None:
                results: Iterator[FitOutput | Exception] = (
                    RuntimeError(taken.failure) for _ in tasks)
            elif isinstance(taken.message, TrainedChunk):  # trained in this process
                results = chunk_outputs(weights, tasks, taken.message)
            else:
                results = outputs(weights, tasks, taken.message)
            for result in results:
                yield result
                self._check_current(round_id)

    def _check_current(self, round_id: int) -> None:
        if round_id != self._round:
            raise RuntimeError(
                "a later fit() call, or close(), ended this round before all of its "
                "results were read; read each round's results before the next fit()")

    def _settle(self) -> None:
        """Drain results the last round left unread; replace workers that exited."""
        for worker in self._workers:
            worker.discard()
        for n, worker in enumerate(self._workers):
            if worker.exited or not worker.process.is_alive():
                worker.stop()
                self._workers[n] = Worker(n, self._job, self._context)

    def close(self) -> None:
        """Stop and reap the worker processes; calling it again does nothing."""
        self._round += 1  # an unfinished round's iterator now raises
        self._stop()

    def __enter__(self) -> ParallelFitter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
