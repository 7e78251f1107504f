"""Streaming weighted mean of client deltas (FedAvg's aggregator).

Keeps one float64 running sum per tensor, so memory is constant in the number of
clients (FedJAX keeps "a running weighted mean of client updates ... to avoid loading
all the client outputs into memory"; so do we). Each update is weighted by its
``num_examples``; integer means are rounded half to even.

Speed and memory: updates are never materialised whole.

- Updates the server holds as spool files (`fedloom.payload.BlockSource`) wait, as
  file references (no memory), until the round ends or ``group_size`` of them are in;
  the group is then folded in one pass, a window of elements at a time: the windows of
  up to `BLOCK_ROWS` files are read (``pread``) into the rows of a cache-resident
  block, whose weighted sum is formed there in float64 (a BLAS ``dot``: three times
  faster than ``einsum`` here). The input is read once, at page-cache speed. A large
  tensor is folded by ``fold_threads`` threads at once (``pread``, numpy and BLAS
  release the GIL), which take runs of windows from one shared queue; every element is
  summed the same way whichever thread folds it, so the result does not depend on
  the thread count. When one group holds every update of the round (up
  to ``group_size`` clients), the means are written directly and no running sum ever
  exists: memory is the mean plus a few cache-sized buffers, whatever the number of
  clients. Larger rounds fold a group into float64 running sums each time one fills.
- In-memory updates are folded at once, a window at a time.

Every product and sum is float64 on both paths (products of float32 values and
integer weights are exact), so the result does not depend on which path an update
took, and, rounded to float32, practically not on arrival order either.
- ``finalize`` turns each float64 sum into the mean in the tensor's own dtype in place
  (the float32 mean is written over the front of the sum's buffer) and returns the
  rest of the buffer to the operating system, so producing the mean costs no memory.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeGuard

import numpy as np
from threadpoolctl import ThreadpoolController

from fedloom.errors import AggregationError
from fedloom.payload import BlockReader, BlockSource
from fedloom.stacked import WeightsRow
from fedloom.strategies._base import Aggregator, MeanUpdate
from fedloom.strategies._rows import fold_rows, windows
from fedloom.types import ClientUpdate
from fedloom.weights import TensorSpec, Weights

#: Spooled updates that wait (as files) before they are folded into running sums.
GROUP_SIZE = 128
#: Files read into one cache-resident block (a window of each) per weighted sum.
BLOCK_ROWS = 16
#: Elements per window (a block of windows, widened to float64, stays in cache).
WINDOW = 1 << 15
#: Sums at least this large live in their own mapping, released in part at finalize.
OWN_MAPPING_BYTES = 1 << 20
#: Most threads a fold uses by default (each holds its own cache-sized block buffers).
MAX_FOLD_THREADS = 4
#: Fewest windows a fold thread takes on (smaller tensors are folded by one thread).
MIN_WINDOWS_PER_THREAD = 8
#: Windows a fold thread takes from the shared queue at a time.
WINDOWS_PER_TAKE = 4


_blas: ThreadpoolController | None = None


def _one_blas_thread() -> contextlib.AbstractContextManager[object]:
    """Keep numpy's BLAS to one thread while a group is folded: the fold threads call
    ``dot`` on blocks large enough for OpenBLAS to start its own threads, which then
    spin against the fold threads (measured: 1.9 s instead of 0.29 s for 50 updates
    of 10M parameters)."""
    global _blas
    if _blas is None:  # found once: which BLAS numpy loaded
        _blas = ThreadpoolController()
    return _blas.limit(limits=1, user_api="blas")


def default_fold_threads() -> int:
    """Threads per fold: the CPUs this process may use, at most `MAX_FOLD_THREADS`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_FOLD_THREADS, cpus))


def check_aggregatable(current: Weights) -> None:
    """Refuse layouts the delta rules cannot handle (boolean tensors)."""
    for name, arr in current.items():
        if arr.dtype == np.bool_:
            raise AggregationError(
                f"tensor {name!r} is boolean: a delta of booleans has no meaning; "
                "send it as an integer or float tensor, or keep it out of the model weights"
            )


def cast_like(reference: np.ndarray, value64: np.ndarray) -> np.ndarray:
    """Cast a float64 result to ``reference``'s dtype: integers round half to even."""
    if reference.dtype.kind in "iu":
        return np.rint(value64).astype(reference.dtype)
    return value64.astype(reference.dtype, copy=False)


class _Sum:
    """A float64 running sum; a large one lives in its own anonymous mapping, so that
    `mean` can write the mean over its front and release the rest."""

    def __init__(self, spec: TensorSpec) -> None:
        self.spec = spec
        nbytes = spec.size * 8
        self.mapping: mmap.mmap | None = None
        if nbytes >= OWN_MAPPING_BYTES:  # private (not shmem), huge pages where allowed
            self.mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            with contextlib.suppress(AttributeError, OSError):
                self.mapping.madvise(mmap.MADV_HUGEPAGE)
            self.flat = np.frombuffer(self.mapping, np.float64)
        else:
            self.flat = np.empty(spec.size, np.float64)
        self.fresh = True  # not written yet: the first fold writes instead of adding

    def mean(self, total: float) -> np.ndarray:
        """``sum / total`` in the tensor's dtype; the sum is unusable afterwards."""
        spec, flat = self.spec, self.flat
        if spec.numpy_dtype.kind != "f" or self.mapping is None:
            value = np.divide(flat, total, out=flat).reshape(spec.shape)
            if spec.numpy_dtype.kind in "iu":
                return np.rint(value).astype(spec.numpy_dtype)
            return value.astype(spec.numpy_dtype, copy=False)
        buffer = self.mapping
        out = np.frombuffer(buffer, spec.numpy_dtype, count=spec.size)
        tmp = np.empty(min(spec.size, WINDOW), np.float64)
        # Window by window: a window's bytes are read before anything overwrites them,
        # and the output (half as wide or less) never reaches bytes not yet read.
        for start, end in windows(spec.size, WINDOW):
            part = tmp[: end - start]
            np.divide(flat[start:end], total, out=part)
            out[start:end] = part
        used = -(-out.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        if used < len(buffer):
            buffer.madvise(mmap.MADV_DONTNEED, used, len(buffer) - used)
        return out.reshape(spec.shape)


def _is_block_source(delta: Weights) -> TypeGuard[BlockSource]:
    """``isinstance(delta, BlockSource)``, without the cost of a check against a runtime
    protocol (tens of microseconds, a fifth of folding a small model's update)."""
    return type(delta) is not Weights and isinstance(delta, BlockSource)


class WeightedMeanAggregator(Aggregator):
    """Weighted mean of deltas by ``num_examples``, as a stream.

    Args:
        group_size: spooled updates folded together (1 folds each on arrival).
        fold_threads: threads that fold a group's large tensors (None: the CPUs this
            process may use, at most `MAX_FOLD_THREADS`).
    """

    holds_all_updates = False

    def __init__(self, group_size: int = GROUP_SIZE, fold_threads: int | None = None) -> None:
        if group_size < 1:
            raise ValueError("group_size must be at least 1")
        if fold_threads is not None and fold_threads < 1:
            raise ValueError("fold_threads must be at least 1")
        self.group_size = group_size
        self.fold_threads = default_fold_threads() if fold_threads is None else fold_threads
        self._current: Weights | None = None
        self._specs: tuple[TensorSpec, ...] = ()
        self._sums: dict[str, _Sum] = {}
        self._waiting: list[tuple[BlockSource, float]] = []  # spool files, not arrays
        self._rows: list[tuple[WeightsRow, float]] = []  # rows of one stack, folded at once
        self._total = 0.0
        self._count = 0

    def start(self, current: Weights) -> None:
        check_aggregatable(current)
        self._current = current
        self._specs = current.specs()
        self._sums = {}
        self._waiting = []
        self._rows = []
        self._total = 0.0
        self._count = 0

    def accumulate(self, update: ClientUpdate) -> None:
        if self._current is None:
            raise AggregationError("accumulate() called before start()")
        delta, weight = update.delta, float(update.num_examples)
        if isinstance(delta, WeightsRow):
            if not self._rows or self._rows[0][0].stack is not delta.stack:
                self._current.check_same_layout(delta, what=f"update from {update.client_id}")
                self._fold_rows()
            self._rows.append((delta, weight))
            self._total += weight
            self._count += 1
            return
        self._current.check_same_layout(delta, what=f"update from {update.client_id}")
        if self.group_size > 1 and _is_block_source(update.delta):
            self._waiting.append((update.delta, weight))
            if len(self._waiting) >= self.group_size:
                self._fold_waiting()
        else:
            self._fold_in_memory(update.delta, weight)
        self._total += weight
        self._count += 1

    def finalize(self) -> MeanUpdate:
        if self._current is None:
            raise AggregationError("finalize() called before start()")
        self._fold_rows()
        total, count = self._total, self._count
        direct: dict[str, np.ndarray] = {}
        if self._waiting and not self._sums:
            # Every update is in this one group: write the means, skip the sums.
            direct = self._fold_waiting(mean_over=total)
        else:
            self._fold_waiting()
        specs, sums = self._specs, self._sums
        self._current, self._sums = None, {}
        if count == 0:
            return MeanUpdate(None, 0.0, 0, reason="no updates to aggregate")
        mean = []
        for spec in specs:  # each sum is dropped as soon as its mean exists
            value = direct.pop(spec.name, None)
            if value is None:
                value = sums.pop(spec.name).mean(total)
            mean.append((spec.name, value))
        return MeanUpdate(Weights(mean), total, count, owned=True)  # fresh arrays

    # -- folding --------------------------------------------------------------------
    def _sum_of(self, spec: TensorSpec) -> tuple[np.ndarray, bool]:
        """The flattened running sum of a tensor, and whether it is fresh (unwritten:
        the first fold writes it instead of adding to zeros)."""
        entry = self._sums.get(spec.name)
        if entry is None:
            entry = self._sums[spec.name] = _Sum(spec)
        fresh, entry.fresh = entry.fresh, False
        return entry.flat, fresh

    def _fold_rows(self) -> None:
        rows, self._rows = self._rows, []
        fold_rows(rows, self._specs, self._sum_of)

    def _fold_in_memory(self, delta: Weights, weight: float) -> None:
        """Exact float64 products and sums, a window of temporaries at a time."""
        for spec in self._specs:
            acc, fresh = self._sum_of(spec)
            flat = np.asarray(delta[spec.name]).reshape(-1)
            if acc.size <= WINDOW:  # one window: no loop (per-call costs rule small models)
                if fresh:
                    np.multiply(flat, weight, out=acc, dtype=np.float64)
                else:
                    acc += np.multiply(flat, weight, dtype=np.float64)
                continue
            tmp = np.empty(min(acc.size, WINDOW), np.float64)
            for start, end in windows(acc.size, WINDOW):
                if fresh:
                    np.multiply(flat[start:end], weight, out=acc[start:end], dtype=np.float64)
                    continue
                part = tmp[: end - start]
                np.multiply(flat[start:end], weight, out=part, dtype=np.float64)
                np.add(acc[start:end], part, out=acc[start:end])

    def _fold_waiting(self, mean_over: float | None = None) -> dict[str, np.ndarray]:
        """Fold the waiting group into the sums or, given ``mean_over`` (the total
        weight, when this group is every update), return the means directly."""
        group, self._waiting = self._waiting, []
        means: dict[str, np.ndarray] = {}
        if not group:
            return means
        with contextlib.ExitStack() as stack:
            stack.enter_context(_one_blas_thread())
            # One pool for the whole group (its threads start on first use and serve
            # every large tensor), not one per tensor.
            pool = stack.enter_context(
                ThreadPoolExecutor(self.fold_threads, thread_name_prefix="fedloom-fold"))
            readers = []
            for source, _ in group:
                reader = source.open_blocks()
                stack.callback(reader.close)
                readers.append(reader)
            scales = np.array([w for _, w in group], np.float64)
            for spec in self._specs:
                mean = self._fold_group(spec, readers, scales, mean_over, pool)
                if mean is not None:
                    means[spec.name] = mean
        return means

    def _fold_group(
        self,
        spec: TensorSpec,
        readers: list[BlockReader],
        scales: np.ndarray,
        mean_over: float | None,
        pool: ThreadPoolExecutor,
    ) -> np.ndarray | None:
        """One pass over the group's files for one tensor; given ``mean_over`` (the
        total weight) the windows' sums are divided by it into the returned mean, else
        they go into the running sum. A large tensor's windows are folded by several
        threads, each taking runs of windows from one queue (disjoint targets)."""
        size = spec.size
        width = max(1, min(size, WINDOW))
        out, emit = self._window_target(spec, width, mean_over)
        windows = -(-size // width)
        threads = max(1, min(self.fold_threads, windows // MIN_WINDOWS_PER_THREAD))
        if threads == 1:
            _fold_ranges(spec, readers, scales, iter([(0, size)]), width, emit)
        else:
            # Threads take runs of windows from one shared queue as they go (next() on
            # a list iterator is atomic), so a thread that loses its CPU for a while
            # delays only the run in its hands, not a fixed half of the tensor.
            step = WINDOWS_PER_TAKE * width
            todo = iter([(a, min(size, a + step)) for a in range(0, size, step)])
            done = [pool.submit(_fold_ranges, spec, readers, scales, todo, width, emit)
                    for _ in range(threads)]
            wait(done)  # all of them, even after an error: the readers close after this
            for future in done:
                future.result()  # re-raises a thread's error (e.g. a short file)
        return out.reshape(spec.shape) if out is not None else None

    def _window_target(
        self, spec: TensorSpec, width: int, mean_over: float | None
    ) -> tuple[np.ndarray | None, Callable[[int, int, np.ndarray], None]]:
        """Where a window's group sum goes: the running sum (written when fresh, else
        added) or, given ``mean_over``, divided by it into a new mean array."""
        if mean_over is None:
            acc, fresh = self._sum_of(spec)

            def into_sum(start: int, end: int, window: np.ndarray) -> None:
                if fresh:
                    acc[start:end] = window
                else:
                    np.add(acc[start:end], window, out=acc[start:end])

            return None, into_sum
        total = mean_over
        out = np.empty(spec.size, spec.numpy_dtype)
        integer = spec.numpy_dtype.kind in "iu"

        def into_mean(start: int, end: int, window: np.ndarray) -> None:
            np.divide(window, total, out=window)
            out[start:end] = np.rint(window) if integer else window

        return out, into_mean


def _fold_ranges(
    spec: TensorSpec,
    readers: list[BlockReader],
    scales: np.ndarray,
    ranges: Iterator[tuple[int, int]],
    width: int,
    emit: Callable[[int, int, np.ndarray], None],
) -> None:
    """Fold the element ranges taken from ``ranges`` of one tensor, a window at a time:
    each file's window is read into a row of a cache-resident block, the block is
    widened to float64 and its rows' weighted sum formed there (products of float32
    values and integer weights are exact in float64), and each window's sum goes to
    ``emit``. Holds its own buffers, so threads can share one ``ranges`` queue."""
    height = min(len(readers), BLOCK_ROWS)
    block = np.empty((height, width), spec.numpy_dtype)
    wide = block if block.dtype == np.float64 else np.empty((height, width), np.float64)
    window_sum = np.empty(width, np.float64)
    block_sum = np.empty(width, np.float64)
    for first, last in ranges:
        for start in range(first, last, width):
            n = min(last, start + width) - start
            for top in range(0, len(readers), height):
                rows = readers[top : top + height]
                for row, reader in enumerate(rows):
                    reader.read_into(spec.name, start, block[row, :n])
                k = len(rows)
                if wide is not block:
                    np.copyto(wide[:k, :n], block[:k, :n])
                into = window_sum[:n] if top == 0 else block_sum[:n]
                np.dot(scales[top : top + k], wide[:k, :n], out=into)
                if top:
                    np.add(window_sum[:n], into, out=window_sum[:n])
            emit(start, start + n, window_sum[:n])
