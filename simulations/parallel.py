"""`ParallelFitter`: a synchronous round's clients trained in worker processes.

A `fedloom.simulations.fitting.RoundFitter` for the local engine. ``workers`` processes
start once, each with one torch thread and its own copy of the `Job`; each builds the
clients it is asked for from the job (cached, sharing one model object per process)
and trains them as the serial local engine does (`fedloom.simulations.lean`). A round
sends every worker one message: the weights, pickled once for all workers, and its
chunks of the tasks.

The round's tasks are cut into chunks of consecutive tasks, dealt to the workers in
turn (chunk ``c`` to worker ``c % workers``): small enough that each worker has two,
and never holding more than ``chunk_bytes`` of trained weights. A worker sends each
chunk as one message, its clients' weights as rows of one array per tensor; the engine
reads the chunks in task order, so it takes a worker's first chunk while the workers
train their second, and a worker's next chunk waits in its pipe (the worker then
waits): memory stays bounded by a few chunks, even for a large model (whose chunks
hold one client each).

Each client's `FitOutput` equals what its `TorchClient.fit` returns, bit for bit (the
same code on one thread); the round's aggregate differs from the serial engine's only
in the order of its float64 sums (a float32 ulp at most), and it is the same in every
run with the same number of workers and clients.

Failures: a client that raises gives a `RuntimeError` in its slot (its type, message
and, as ``__cause__``, the worker's traceback) and the round goes on. A worker that
dies gives each task of its unfinished chunks a `RuntimeError` naming its exit code
and clients; a new worker replaces it at the next `fit`.

Limits: each worker holds a whole copy of the job's data (and this process keeps the
pickled job, to start replacements); a worker that hangs (neither answers nor exits)
stalls the round, as a hanging client stalls the serial engine; a result reaches the
engine when its chunk is done. The script that creates the fitter must guard its entry
point with ``if __name__ == "__main__":`` (both start methods import it afresh in each
worker).

Speed: the workers take the fits; this process takes each chunk's deltas and weighted
sum a chunk at a time (`fedloom.stacked`), so its share per client is small, and a
round's fixed costs (sampling, the messages) stay serial. `benchmarks/simulation.py`
measures it beside the serial engine (the figures are in benchmarks/README.md).

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
import math
import multiprocessing
import pickle
import signal
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
from fedloom.simulations.lean import CHUNK_BYTES, LeanFitter, TrainedChunk, chunk_outputs
from fedloom.weights import Weights

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext

    from fedloom.simulations.job import Job

#: Start methods that give a worker a fresh interpreter. ``fork`` is refused: it copies
#: a parent that has imported torch, whose thread pools and locks do not survive it.
START_METHODS = ("spawn", "forkserver")
_STOP_TIMEOUT_S = 5.0


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
    """A worker's loop: read the job, then train each round's chunks until told to stop."""
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

    def client_fn(index: int) -> Client:
        if index not in clients:
            clients[index] = job.make_client(index, model=shared)
        return clients[index]

    lean = LeanFitter(client_fn)
    while True:
        try:
            chunks: list[list[FitTask]] | None = conn.recv()
            if chunks is None:
                return
            weights: Weights = pickle.loads(conn.recv_bytes())
        except EOFError:  # the parent is gone
            return
        for chunk in chunks:
            try:
                conn.send_bytes(_pickled(lean.train_chunk(weights, chunk)))
            except OSError:  # the parent closed the pipe: it is stopping us
                return


def _pickled(chunk: TrainedChunk) -> bytes:
    """A trained chunk as one message; exceptions (and records that do not pickle, e.g.
    a metric a client made unpicklable) as `_ClientError` text."""
    records: list[object] = [
        _ClientError.of(r) if isinstance(r, Exception) else r for r in chunk.records]
    try:
        return pickle.dumps((chunk.arrays, records), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        for i, record in enumerate(records):
            try:
                pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                records[i] = _ClientError.of(exc)
        return pickle.dumps((chunk.arrays, records), protocol=pickle.HIGHEST_PROTOCOL)


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
        self.pending: collections.deque[list[FitTask]] = collections.deque()  # chunks owed
        self.failure = ""

    @property
    def exited(self) -> bool:
        return bool(self.failure)

    def dispatch(self, weights: bytes, chunks: list[list[FitTask]]) -> None:
        self.pending.extend(chunks)
        try:
            if self.job is not None:
                self.conn.send_bytes(self.job)
                self.job = None
            self.conn.send(chunks)
            self.conn.send_bytes(weights)
        except OSError:
            self._exited()

    def receive(self, weights: Weights) -> Iterator[FitOutput | Exception]:
        """The results of the oldest pending chunk, in its task order (waits for it)."""
        tasks = self.pending[0]
        message = self._next()
        if message is None:
            yield from (RuntimeError(self.failure) for _ in tasks)
            return
        arrays, records = pickle.loads(message)
        chunk = TrainedChunk(arrays, [r.exception() if isinstance(r, _ClientError) else r
                                      for r in records])
        yield from chunk_outputs(weights, tasks, chunk)

    def discard(self) -> None:
        """Wait for the chunks still owed and drop them."""
        while self.pending:
            self._next()

    def _next(self) -> bytes | None:
        """The oldest pending chunk's message; None when the worker died first."""
        message = None if self.failure else self._read()
        self.pending.popleft()
        return message

    def _read(self) -> bytes | None:
        ready = wait([self.conn, self.process.sentinel])
        try:
            if self.conn in ready or self.conn.poll():
                return self.conn.recv_bytes()
        except (EOFError, OSError):
            pass
        self._exited()
        return None

    def _exited(self) -> None:
        code = self._reap()
        clients = ", ".join(str(task.index) for chunk in self.pending for task in chunk)
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


def chunk_size(tasks: int, workers: int, rows: int) -> int:
    """Tasks per chunk: at most ``rows`` (the weights that fit in the chunk budget), and
    small enough that each worker gets two chunks, so the engine takes a worker's first
    chunk while the workers train their second."""
    return max(1, min(rows, math.ceil(tasks / (2 * workers))))


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
        chunk_bytes: the most bytes of trained weights one chunk holds.

    Raises:
        ConfigError: ``workers`` or ``chunk_bytes`` below 1, or another start method.
    """

    def __init__(self, job: Job, workers: int, *, start_method: str = "spawn",
                 chunk_bytes: int = CHUNK_BYTES) -> None:
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
        size = chunk_size(len(tasks), count, self._rows(weights))
        chunks = [list(tasks[begin:begin + size]) for begin in range(0, len(tasks), size)]
        for worker in self._workers:
            share = chunks[worker.number::count]
            if share:
                worker.dispatch(blob, share)
        return self._results(self._round, list(self._workers), weights, len(chunks))

    def _rows(self, weights: Weights) -> int:
        return max(1, self.chunk_bytes // max(1, weights.nbytes))

    def _results(
        self, round_id: int, workers: list[_Worker], weights: Weights, num_chunks: int
    ) -> Iterator[FitOutput | Exception]:
        for position in range(num_chunks):
            if round_id != self._round:
                raise RuntimeError(
                    "a later fit() call, or close(), ended this round before all of its "
                    "results were read; read each round's results before the next fit()"
                )
            for result in workers[position % len(workers)].receive(weights):
                yield result
                if round_id != self._round:
                    raise RuntimeError(
                        "a later fit() call, or close(), ended this round before all of "
                        "its results were read; read each round's results before the "
                        "next fit()")

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
