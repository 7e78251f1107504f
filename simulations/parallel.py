"""`ParallelFitter`: a synchronous round's clients trained in worker processes.

A `fedloom.simulations.fitting.RoundFitter` for the local engine. ``workers`` processes
start once, each with one torch thread and its own copy of the `Job`; each builds the
clients it is asked for from the job (cached, sharing one model object per process, as
the serial engine shares one in its process). A round sends every worker one message:
the weights, pickled once for all workers, and its share of the tasks. The engine then
gets the results in task order, each as soon as it and those before it have arrived.

Task ``i`` goes to worker ``i % workers``. Reading the results in order then takes
them from the workers in turn, so the tasks a worker has finished but the engine has
not yet asked for wait in the worker's pipe (at most a few, then the worker waits):
memory stays bounded as with a streaming aggregator, even for a large model. Fits of
one round cost about the same, so equal shares keep the workers equally busy.

Every fit runs the same code as in `SerialFitter` (the client reseeds from its fit
config), on one thread, so the engine's model equals the serial engine's bit for bit.

Failures: a client that raises gives a `RuntimeError` in its slot (its type, message
and, as ``__cause__``, the worker's traceback) and the round goes on. A worker that
dies gives each of its unfinished tasks a `RuntimeError` naming its exit code and
clients; a new worker replaces it at the next `fit`.

Limits: each worker holds a whole copy of the job's data (and this process keeps the
pickled job, to start replacements); a worker that hangs (neither answers nor exits)
stalls the round, as a hanging client stalls `SerialFitter`; a result reaches the
engine up to 5 ms, or one further fit, after its fit ends. The script that
creates the fitter must guard its entry point with ``if __name__ == "__main__":``
(both start methods import it afresh in each worker).

Speed: the workers take the fits, but this process still reads every result and does
the engine's own work on it (the delta, the aggregation), competing with the workers
for the cores; so the gain grows with a fit's cost against its update's size, and a
round's fixed costs stay serial. `benchmarks/simulation.py` measures it beside the
serial engine (the figures are in benchmarks/README.md).

Example::

    from fedloom.simulations.parallel import ParallelFitter

    with ParallelFitter(job, workers=4) as fitter:
        history = run_local(strategy, client_fn, initial, num_clients=100,
                            num_rounds=20, fitter=fitter)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import multiprocessing
import pickle
import signal
import time
import traceback
import weakref
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection, wait
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from fedloom.client_sdk._client import Client, FitOutput
from fedloom.errors import ConfigError
from fedloom.simulations.fitting import FitTask
from fedloom.weights import Weights

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext

    from fedloom.simulations.job import Job

#: Start methods that give a worker a fresh interpreter. ``fork`` is refused: it copies
#: a parent that has imported torch, whose thread pools and locks do not survive it.
START_METHODS = ("spawn", "forkserver")
_STOP_TIMEOUT_S = 5.0
#: A worker sends the results it holds once this long has passed since it last sent.
#: A message that wakes the parent costs both processes 0.1-0.2 ms of CPU on a virtual
#: machine, a third of a small model's fit: one message per fit wastes that much.
_FLUSH_S = 0.005


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in a worker process."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclasses.dataclass(frozen=True)
class _ClientError:
    """A worker's exception as plain text: the original may not survive pickling."""

    kind: str
    message: str
    traceback: str

    @classmethod
    def of(cls, exc: BaseException) -> _ClientError:
        return cls(type(exc).__qualname__, str(exc), "".join(traceback.format_exception(exc)))

    def exception(self) -> RuntimeError:
        error = RuntimeError(f"{self.kind}: {self.message}")
        error.__cause__ = RemoteTraceback(self.traceback)
        return error


def _serve(conn: Connection) -> None:
    """A worker's loop: read the job, then fit each batch of tasks until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops us
    torch.set_num_threads(1)  # as Ray's actors and the serial engine: the same kernels
    try:
        job: Job | None = pickle.loads(conn.recv_bytes())
    except EOFError:
        return
    if job is None:  # stopped before its first batch
        return
    shared = job.make_model()
    clients: dict[int, Client] = {}

    def fit(task: FitTask, weights: Weights) -> bytes:
        result: FitOutput | _ClientError
        try:
            if task.index not in clients:
                clients[task.index] = job.make_client(task.index, model=shared)
            result = clients[task.index].fit(weights, task.config)
        except Exception as exc:  # a failed client is data, not the end of the round
            result = _ClientError.of(exc)
        try:
            return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # e.g. a metric the client made unpicklable
            return pickle.dumps(_ClientError.of(exc), protocol=pickle.HIGHEST_PROTOCOL)

    while True:
        try:
            tasks: list[FitTask] | None = conn.recv()
            if tasks is None:
                return
            weights: Weights = pickle.loads(conn.recv_bytes())
        except EOFError:  # the parent is gone
            return
        unsent: list[bytes] = []
        sent_at = time.perf_counter()
        for done, task in enumerate(tasks, start=1):
            unsent.append(fit(task, weights))
            left = len(tasks) - done
            # See _FLUSH_S; sending when as many are unsent as are left to fit makes the
            # last messages small, so the parent's work on them overlaps our fits.
            if left == 0 or len(unsent) >= left or time.perf_counter() - sent_at >= _FLUSH_S:
                try:
                    conn.send_bytes(_frame(unsent))
                except OSError:  # the parent closed the pipe: it is stopping us
                    return
                unsent, sent_at = [], time.perf_counter()


def _frame(results: list[bytes]) -> bytes:
    """Pickled results as one message, each after its length (8 bytes, little-endian)."""
    return b"".join(part for result in results for part in (len(result).to_bytes(8, "little"),
                                                            result))


def _unframe(message: bytes) -> Iterator[memoryview]:
    """The pickled results in a `_frame` message, without copying them."""
    view, at = memoryview(message), 0
    while at < len(view):
        size = int.from_bytes(view[at:at + 8], "little")
        yield view[at + 8:at + 8 + size]
        at += 8 + size


class _Worker:
    """One worker process, its pipe, and the clients whose results it still owes."""

    def __init__(
        self, number: int, job: bytes, context: SpawnContext | ForkServerContext
    ) -> None:
        self.number = number
        parent, child = context.Pipe()
        # The job goes through the pipe with the first batch, not as an argument: start()
        # would wait, worker by worker, until each had imported torch and read it.
        self.job: bytes | None = job
        self.process = context.Process(
            target=_serve, args=(child,), name=f"fedloom-fitter-{number}", daemon=True
        )
        self.process.start()
        child.close()  # only the worker holds its end: its exit then reads as EOF here
        self.conn = parent
        self.pending: collections.deque[int] = collections.deque()  # clients owed, in order
        self.received: collections.deque[memoryview] = collections.deque()  # their results
        self.failure = ""

    @property
    def exited(self) -> bool:
        return bool(self.failure)

    def dispatch(self, weights: bytes, tasks: list[FitTask]) -> None:
        self.pending.extend(task.index for task in tasks)
        try:
            if self.job is not None:
                self.conn.send_bytes(self.job)
                self.job = None
            self.conn.send(tasks)
            self.conn.send_bytes(weights)
        except OSError:
            self._exited()

    def receive(self) -> FitOutput | Exception:
        """The result of the oldest pending task (waits for it)."""
        blob = self._next()
        if blob is None:
            return RuntimeError(self.failure)
        result: FitOutput | _ClientError = pickle.loads(blob)
        return result.exception() if isinstance(result, _ClientError) else result

    def discard(self) -> None:
        """Wait for the results still owed and drop them."""
        while self.pending:
            self._next()

    def _next(self) -> memoryview | None:
        """The oldest pending task's pickled result; None when the worker died first."""
        if not self.received and not self.failure:
            self._read()
        self.pending.popleft()
        return self.received.popleft() if self.received else None

    def _read(self) -> None:
        ready = wait([self.conn, self.process.sentinel])
        try:
            if self.conn in ready or self.conn.poll():
                self.received.extend(_unframe(self.conn.recv_bytes()))
                return
        except (EOFError, OSError):
            pass
        self._exited()

    def _exited(self) -> None:
        code = self._reap()
        unfinished = list(self.pending)[len(self.received):]  # the first ones were sent
        clients = ", ".join(str(i) for i in unfinished)
        self.failure = (
            f"worker {self.number} exited with code {code} while fitting clients {clients}"
        )

    def _reap(self) -> int | None:
        self.process.join(1.0)
        if self.process.is_alive():  # closed its pipe yet lives on: do not keep it
            self.process.kill()
            self.process.join()
        return self.process.exitcode

    def ask_to_stop(self) -> None:
        if self.job is not None:  # never given work: it holds nothing worth a clean exit
            self.process.terminate()
        with contextlib.suppress(OSError):  # it exited already
            self.conn.send(None)
        self.conn.close()  # a worker blocked sending results unused gets EPIPE and exits

    def stop(self) -> None:
        """Ask the worker to exit, wait a while, then terminate it; reap it either way."""
        if not self.conn.closed:
            self.ask_to_stop()
        self.process.join(_STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(_STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.process.close()


def _stop_all(workers: list[_Worker]) -> None:
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

    Raises:
        ConfigError: ``workers`` below 1, or another start method.
    """

    def __init__(self, job: Job, workers: int, *, start_method: str = "spawn") -> None:
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
        self._job = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
        self._context: SpawnContext | ForkServerContext = (
            multiprocessing.get_context("spawn") if start_method == "spawn"
            else multiprocessing.get_context("forkserver")
        )
        self._workers = [_Worker(n, self._job, self._context) for n in range(workers)]
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
        count = len(self._workers)
        for worker in self._workers:
            share = list(tasks[worker.number::count])
            if share:
                worker.dispatch(blob, share)
        return self._results(self._round, list(self._workers), len(tasks))

    def _results(
        self, round_id: int, workers: list[_Worker], num_tasks: int
    ) -> Iterator[FitOutput | Exception]:
        for position in range(num_tasks):
            if round_id != self._round:
                raise RuntimeError(
                    "a later fit() call, or close(), ended this round before all of its "
                    "results were read; read each round's results before the next fit()"
                )
            yield workers[position % len(workers)].receive()

    def _settle(self) -> None:
        """Drain results the last round left unread; replace workers that exited."""
        for worker in self._workers:
            worker.discard()
        for n, worker in enumerate(self._workers):
            if worker.exited or not worker.process.is_alive():
                worker.stop()
                self._workers[n] = _Worker(n, self._job, self._context)

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
