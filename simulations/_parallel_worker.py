"""The worker side of `fedloom.simulations.parallel`: the process loop, and `Worker`,
the engine's handle on one worker process.

What travels, over two one-way pipes per worker:

- to the worker: the pickled `Job` (once, before its first round), then per round
  `WEIGHTS` and the pickled weights, then one message per chunk it is given (a list of
  `FitTask`); None asks it to exit;
- from the worker: one message per chunk, in the order the chunks were given: the
  trained rows (an array per tensor) and one record per task (see `TrainedChunk`),
  exceptions as `ClientError` text.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import pickle
import signal
import traceback
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

import torch

from fedloom.client_sdk._client import FitOutput
from fedloom.simulations.fitting import FitTask
from fedloom.simulations.lean import LeanFitter, TrainedChunk, chunk_outputs
from fedloom.weights import Weights

try:
    import fcntl
except ImportError:  # not on Windows: pipes keep their default size there
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from collections.abc import Iterator
    from multiprocessing.context import ForkServerContext, SpawnContext

    from fedloom.simulations.job import Job

#: The message that announces a round's weights.
WEIGHTS = "weights"
#: What a worker's result pipe may hold (Linux's default limit for an unprivileged
#: process): a few chunks of a small model.
PIPE_BYTES = 2**20
STOP_TIMEOUT_S = 5.0


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in a worker process."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclasses.dataclass(frozen=True)
class ClientError:
    """A worker's exception as plain text: the original may not survive pickling."""

    kind: str
    message: str
    traceback: str

    @classmethod
    def of(cls, exc: BaseException) -> ClientError:
        return cls(type(exc).__qualname__, str(exc), "".join(traceback.format_exception(exc)))

    def exception(self) -> RuntimeError:
        error = RuntimeError(f"{self.kind}: {self.message}")
        error.__cause__ = RemoteTraceback(self.traceback)
        return error


def serve(conn: Connection, results: Connection) -> None:
    """A worker's loop: read the job, then train each chunk it is given on the round's
    weights, until told to stop (``conn`` brings the work, ``results`` takes it back)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops us
    torch.set_num_threads(1)  # as Ray's actors and the serial engine: the same kernels
    try:
        job: Job | None = pickle.loads(conn.recv_bytes())
    except EOFError:
        return
    if job is None:  # stopped before its first round
        return
    lean = LeanFitter(job.client_fn())
    weights: Weights | None = None
    while True:
        try:
            message: str | list[FitTask] | None = conn.recv()
            if message is None:
                return
            if message == WEIGHTS:
                weights = pickle.loads(conn.recv_bytes())
                continue
        except EOFError:  # the parent is gone
            return
        assert weights is not None and isinstance(message, list)
        try:
            results.send_bytes(_pickled(lean.train_chunk(weights, message)))
        except OSError:  # the parent closed the pipe: it is stopping us
            return


def _pickled(chunk: TrainedChunk) -> bytes:
    """A trained chunk as one message; exceptions (and records that do not pickle, e.g.
    a metric a client made unpicklable) as `ClientError` text."""
    records: list[object] = [
        ClientError.of(r) if isinstance(r, Exception) else r for r in chunk.records]
    try:
        return pickle.dumps((chunk.arrays, records), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        for i, record in enumerate(records):
            try:
                pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                records[i] = ClientError.of(exc)
        return pickle.dumps((chunk.arrays, records), protocol=pickle.HIGHEST_PROTOCOL)


def outputs(weights: Weights, tasks: list[FitTask], message: bytes
            ) -> Iterator[FitOutput | Exception]:
    """The task results in a worker's chunk message."""
    arrays, records = pickle.loads(message)
    chunk = TrainedChunk(arrays, [r.exception() if isinstance(r, ClientError) else r
                                  for r in records])
    yield from chunk_outputs(weights, tasks, chunk)


def _widen(conn: Connection) -> None:
    """Let the pipe hold `PIPE_BYTES` (where the system allows; Linux), so a worker's
    chunk goes in one write while the engine reads another worker's: a default 64 KiB
    pipe makes both processes wake a dozen times per chunk, a cost a small model's fit
    cannot hide on a busy machine."""
    setting = getattr(fcntl, "F_SETPIPE_SZ", None) if fcntl is not None else None
    if setting is not None:
        with contextlib.suppress(OSError):  # above the system's limit: keep the default
            fcntl.fcntl(conn.fileno(), setting, PIPE_BYTES)


@dataclasses.dataclass
class Taken:
    """A chunk a worker gave back: its message, or, when the worker died first, None and
    the reason."""

    chunk: int
    message: bytes | TrainedChunk | None
    failure: str = ""


class Worker:
    """One worker process, its pipes, and the chunks it still owes (in order)."""

    def __init__(
        self, number: int, job: bytes, context: SpawnContext | ForkServerContext
    ) -> None:
        self.number = number
        work, self.conn = context.Pipe(duplex=False)
        self.results, sent = context.Pipe(duplex=False)
        _widen(sent)
        # The job goes through the pipe with the first round, not as an argument:
        # start() would wait, worker by worker, until each had imported torch and read it.
        self.job: bytes | None = job
        self.process = context.Process(
            target=serve, args=(work, sent), name=f"fedloom-fitter-{number}", daemon=True
        )
        self.process.start()
        work.close()  # only the worker holds its ends: its exit then reads as EOF here
        sent.close()
        # chunk number and its tasks, in the order given
        self.pending: collections.deque[tuple[int, list[FitTask]]] = collections.deque()
        self.failure = ""

    @property
    def exited(self) -> bool:
        return bool(self.failure)

    @property
    def waitables(self) -> list[Connection | int]:
        """What `multiprocessing.connection.wait` watches for this worker's next event."""
        return [self.results, self.process.sentinel]

    def start_round(self, weights: bytes) -> None:
        """Send the round's (pickled) weights."""
        try:
            if self.job is not None:
                self.conn.send_bytes(self.job)
                self.job = None
            self.conn.send(WEIGHTS)
            self.conn.send_bytes(weights)
        except OSError:
            self._exited()

    def assign(self, chunk: int, tasks: list[FitTask]) -> None:
        self.pending.append((chunk, tasks))
        try:
            self.conn.send(tasks)
        except OSError:
            self._exited()

    def take(self) -> list[Taken]:
        """The oldest pending chunk's message (waits for it) or, when the worker has
        died, every pending chunk with the reason."""
        if not self.failure:
            message = self._read()
            if message is not None:
                chunk, _ = self.pending.popleft()
                return [Taken(chunk, message)]
        failed = [Taken(chunk, None, self.failure) for chunk, _ in self.pending]
        self.pending.clear()
        return failed

    def discard(self) -> None:
        """Wait for the chunks still owed and drop them."""
        while self.pending:
            self.take()

    def _read(self) -> bytes | None:
        try:
            if self.results.poll() or self.results in wait(self.waitables) or (
                    self.results.poll()):
                return self.results.recv_bytes()
        except (EOFError, OSError):
            pass
        self._exited()
        return None

    def _exited(self) -> None:
        code = self._reap()
        clients = ", ".join(str(task.index) for _, tasks in self.pending for task in tasks)
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
        self.conn.close()
        self.results.close()  # a worker blocked sending results unused gets EPIPE and exits

    def stop(self) -> None:
        """Ask the worker to exit, wait a while, then terminate it; reap it either way."""
        if not self.conn.closed:
            self.ask_to_stop()
        self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.process.close()
