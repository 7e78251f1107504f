"""Uploads spooled to disk, so the server's memory does not grow with the clients.

`Spool` receives one upload's chunks into a file under the server's spool folder via
the kernel's `PayloadReceiver` (order, sizes, digest, finite values checked as bytes
arrive). Once whole and verified it becomes `SpooledWeights`: a `Weights` that reads
each tensor from the file only when asked, and that aggregators read block by block
(`fedloom.payload.BlockSource`) so an update is never loaded whole. An `Upload` ties a
spool to the task whose result it carries.

A small upload (its whole payload, at most 64 KiB, in its first chunk) is received into
memory instead, while the server's budget for them allows (`fedloom.server.upload_memory`):
the same receiver and checks, and `HeldWeights`, a `SpooledWeights` read the same way
from its bytes; its consumers cannot tell the two apart, and one that needs a file
(`Spool.path`) gets one.

A zstd-compressed upload (docs/compression.md) is decompressed as its chunks arrive
(`fedloom.compression.ZstdReceiver`) into the same checks and the same file: the spool
holds the payload, never the stream, and no more than a chunk in and a piece out is in
memory at once. A compressed upload refused for what its stream holds (not zstd, more
output than its header declares, short, another digest) records the refusal
(`Upload.refusal`) so that its task's owner fails the task, as for a codec's refusal.
"""

from __future__ import annotations

import abc
import asyncio
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from fedloom.compression import ZstdReceiver
from fedloom.compression._zstd import PIECE_BYTES
from fedloom.errors import MessageRejectedError
from fedloom.messages import ResultHeader
from fedloom.payload import PayloadInfo, PayloadReceiver
from fedloom.server import upload_memory
from fedloom.server.compression import EncodingRefusedError
from fedloom.server.tasks import Task
from fedloom.server.upload_memory import HeldPayload, UploadMemory
from fedloom.weights import TensorSpec, Weights


class TensorReader(abc.ABC):
    """Piecewise reads of a verified upload (`fedloom.payload.BlockReader`): where each
    tensor lies, and the checks of a read; `SpoolReader` and `HeldReader` copy the
    bytes into the caller's buffer."""

    def __init__(self, offsets: dict[str, tuple[int, TensorSpec]]) -> None:
        # name -> (byte offset, dtype, element count): no per-read recomputation.
        self._layout = {
            name: (offset, spec.numpy_dtype, spec.size) for name, (offset, spec) in offsets.items()
        }

    def _place(self, name: str, start: int, out: np.ndarray) -> tuple[int, memoryview]:
        """The byte position of element ``start`` of ``name``, and ``out``'s bytes."""
        offset, dtype, size = self._layout[name]
        if out.dtype != dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous {dtype} array")
        if start < 0 or start + out.size > size:
            raise ValueError(f"elements {start}..{start + out.size} are outside {name!r}")
        return offset + start * dtype.itemsize, out.data.cast("B")

    @abc.abstractmethod
    def read_into(self, name: str, start: int, out: np.ndarray) -> None:
        """Fill ``out`` with elements ``start .. start + len(out)`` of tensor ``name``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the reader holds (its file, its view of the bytes)."""

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SpoolReader(TensorReader):
    """Reads of a spool file: ``pread`` into the caller's buffer, no intermediate copy."""

    def __init__(self, path: Path, offsets: dict[str, tuple[int, TensorSpec]]) -> None:
        super().__init__(offsets)
        self._path = path
        self._fd = os.open(path, os.O_RDONLY)

    def read_into(self, name: str, start: int, out: np.ndarray) -> None:
        position, view = self._place(name, start, out)
        done = os.preadv(self._fd, [view], position)
        while done < len(view):  # a short read: only near the end of a file, or on error
            n = os.preadv(self._fd, [view[done:]], position + done)
            if n == 0:
                raise OSError(f"spool file {self._path} is shorter than its layout")
            done += n

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class HeldReader(TensorReader):
    """Reads of an upload held in memory: one copy into the caller's buffer."""

    def __init__(self, data: memoryview, offsets: dict[str, tuple[int, TensorSpec]]) -> None:
        super().__init__(offsets)
        self._data = data

    def read_into(self, name: str, start: int, out: np.ndarray) -> None:
        position, view = self._place(name, start, out)
        end = position + len(view)
        if end > len(self._data):
            raise OSError("a held upload is shorter than its layout (it was discarded)")
        view[:] = self._data[position:end]

    def close(self) -> None:
        self._data = memoryview(b"")


class _FileSink:
    """Writes whole chunks straight to a file descriptor (no buffer, no extra copy)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(self.fd, view) :]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @property
    def closed(self) -> bool:
        return self.fd < 0


class _ChosenSink:
    """The receiver's sink: verified bytes go on to ``target``, the file or the memory
    `Spool` chose at the first chunk (a sink of its own: the spool's receiver holding
    the spool would keep it, and its held bytes, alive until a garbage collection)."""

    __slots__ = ("target",)

    def __init__(self, target: _FileSink | HeldPayload | None) -> None:
        self.target = target

    def write(self, data: bytes | memoryview) -> None:
        assert self.target is not None  # chosen before the receiver is fed
        self.target.write(data)


class SpooledWeights(Weights):
    """Read-only `Weights` backed by a verified spool file; tensors load on access."""

    __slots__ = ("_offsets", "_path", "_specs")

    def __init__(self, path: Path, specs: tuple[TensorSpec, ...]) -> None:
        super().__init__()
        self._path = path
        self._lay_out(specs)

    def _lay_out(self, specs: tuple[TensorSpec, ...]) -> None:
        self._specs = specs
        offsets, pos = {}, 0
        for spec in specs:
            offsets[spec.name] = (pos, spec)
            pos += spec.nbytes
        self._offsets = offsets

    def __getitem__(self, name: str) -> np.ndarray:
        spec = self._offsets[name][1]
        arr = np.empty(spec.size, spec.numpy_dtype)
        with self.open_blocks() as reader:
            reader.read_into(name, 0, arr)
        arr = arr.reshape(spec.shape)
        arr.flags.writeable = False
        return arr

    def __iter__(self) -> Iterator[str]:
        return iter(self._offsets)

    def __len__(self) -> int:
        return len(self._offsets)

    def specs(self) -> tuple[TensorSpec, ...]:
        return self._specs

    def open_blocks(self) -> TensorReader:
        """Open the file for piecewise reads (`fedloom.payload.BlockSource`)."""
        return SpoolReader(self._path, self._offsets)


class HeldWeights(SpooledWeights):
    """A verified upload held in memory (`Spool`): read as a spool file is (each tensor
    copied out on access, block reads for aggregators), from its bytes. Its reservation
    of the server's upload memory is returned once nothing holds them."""

    __slots__ = ("_held",)

    def __init__(self, held: HeldPayload, specs: tuple[TensorSpec, ...]) -> None:
        Weights.__init__(self)  # no file: the path of `SpooledWeights` is never set
        self._held = held
        self._lay_out(specs)

    def open_blocks(self) -> TensorReader:
        """Piecewise reads of the held bytes (`fedloom.payload.BlockSource`)."""
        return HeldReader(self._held.view(), self._offsets)


class Spool:
    """One upload in progress: chunks go to a temp file; `finish` verifies it.

    An upload whose first chunk carries its whole payload, small enough to be held
    (`fedloom.server.upload_memory`), goes to memory instead while ``memory`` (by default
    the server's `fedloom.server.upload_memory.UPLOAD_MEMORY`) has room for it. An
    upload too large to be held gets its file as its header arrives; one that could be
    held, at its first chunk.
    """

    def __init__(self, folder: Path, info: PayloadInfo, max_chunk_bytes: int, *,
                 memory: UploadMemory | None = None) -> None:
        self._folder = folder
        self._info = info
        self._max_chunk_bytes = max_chunk_bytes
        self._memory = memory if memory is not None else upload_memory.UPLOAD_MEMORY
        self._path: Path | None = None
        self._file: _FileSink | None = None
        self._held: HeldPayload | None = None
        self._sink = _ChosenSink(None)  # memory or file, chosen at the first chunk
        # Held while a chunk is taken in (a zstd chunk is decompressed in a worker
        # thread) and while the spool is discarded: a file is never closed under a write.
        self._lock = threading.Lock()
        try:
            if not self._memory.may_hold(info, max_chunk_bytes):
                self._sink.target = self._open_file()
            self._receiver: PayloadReceiver | ZstdReceiver = PayloadReceiver(
                info.specs,
                info.total_bytes,
                info.sha256,
                self._sink,
                max_chunk_bytes=PIECE_BYTES if info.wire_bytes else max_chunk_bytes,
            )
            if info.wire_bytes:  # the chunks carry a zstd stream of the payload
                self._receiver = ZstdReceiver(self._receiver, info.wire_bytes,
                                              max_chunk_bytes=max_chunk_bytes)
        except BaseException:
            self.discard()
            raise

    def _open_file(self) -> _FileSink:
        self._folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="upload-", suffix=".bin", dir=self._folder)
        self._path = Path(name)
        self._file = _FileSink(fd)  # chunks are large already: a buffer only adds a copy
        return self._file

    def _choose_sink(self, whole: bool) -> _FileSink | HeldPayload:
        """Memory for a payload that came whole in one chunk, if the budget allows."""
        if whole:
            self._held = self._memory.hold(self._info, self._max_chunk_bytes)
        return self._held if self._held is not None else self._open_file()

    @property
    def held(self) -> bool:
        """Whether the upload is received into memory (known from its first chunk)."""
        return self._held is not None

    @property
    def path(self) -> Path:
        """The spool file. A held upload is written to one when first asked, once
        whole, for the owners that need a file (a masked input's memory map, the
        asynchronous rounds' durable buffer); `discard` removes it as any other."""
        if self._path is None:
            assert self._held is not None, "a spool has its file, or its held bytes, once whole"
            sink = self._open_file()
            try:
                sink.write(self._held.view())
            finally:
                sink.close()
        assert self._path is not None
        return self._path

    def choose_sink(self, offset: int, data: bytes) -> None:
        """At the first chunk, memory or a file (the server's upload memory is the
        event loop's to reserve: call it there)."""
        if self._sink.target is None:
            whole = offset == 0 and len(data) == self._info.wire_size
            self._sink.target = self._choose_sink(whole)

    def feed(self, offset: int, data: bytes) -> None:
        self.choose_sink(offset, data)
        with self._lock:
            self._receiver.feed(offset, data)

    @property
    def received(self) -> int:
        return self._receiver.received

    def finish(self) -> SpooledWeights:
        """Verify size and digest; the file (or the held bytes) then backs a
        `SpooledWeights` (a `HeldWeights`)."""
        if self._sink.target is None and self._info.wire_size == 0:  # nothing to send
            self._sink.target = self._choose_sink(whole=True)
        # (Any other upload that sent no chunk is refused below, before a write.)
        if self._file is not None:
            self._file.close()
        self._receiver.finish()
        if self._held is not None:
            return HeldWeights(self._held, self._info.specs)
        assert self._path is not None
        return SpooledWeights(self._path, self._info.specs)

    def discard(self) -> None:
        """Drop what arrived: the held bytes (their reservation is returned), the file.
        A chunk being taken in (in a worker thread) is let finish first."""
        with self._lock:
            if self._held is not None:
                self._held.release()
            if self._file is not None and not self._file.closed:
                self._file.close()
            if self._path is not None:
                self._path.unlink(missing_ok=True)


class Upload:
    """One result payload, from its validated header to its fold, owned by its task's
    owner (`fedloom.server.tasks.TaskOwner`): the servicer only feeds it chunks, then
    finishes it (verified, then folded) or abandons it (the stream broke)."""

    def __init__(self, task: Task, header: ResultHeader, spool: Spool,
                 fingerprint: bytes) -> None:
        self.task = task
        self.header = header
        self.spool = spool
        self.fingerprint = fingerprint  # the result's (`fedloom.server.tasks`), once folded
        #: Why a compressed upload was refused for its stream (its task then fails).
        self.refusal: EncodingRefusedError | None = None
        self._done = False
        task.in_flight = True

    @property
    def size(self) -> int:
        """The bytes its chunks carry, as its header declares them (the zstd stream's,
        when compressed): what the transfer turns, pace and chunk rule count."""
        assert self.header.update is not None  # an upload carries a payload
        return self.header.update.wire_size

    @property
    def received(self) -> int:
        return self.spool.received

    def feed(self, offset: int, data: bytes) -> None:
        try:
            self.spool.feed(offset, data)
        except MessageRejectedError as exc:
            raise self._refused(exc) from None

    async def feed_async(self, offset: int, data: bytes) -> None:
        """`feed`, with a zstd stream's chunk decompressed in a worker thread: a few
        compressed bytes may expand to the whole payload (tens of MiB of zeros), which
        on the event loop would hold every other client's calls meanwhile."""
        assert self.header.update is not None
        if not self.header.update.wire_bytes:
            self.feed(offset, data)
            return
        self.spool.choose_sink(offset, data)
        await asyncio.to_thread(self.feed, offset, data)

    def _refused(self, exc: MessageRejectedError) -> MessageRejectedError:
        """``exc`` as the refusal of a compressed upload's stream (it fails the task)."""
        assert self.header.update is not None
        if not self.header.update.wire_bytes:
            return exc
        self.refusal = EncodingRefusedError(exc.reason, f"the update's zstd stream: {exc}")
        return self.refusal

    async def finish(self) -> None:
        """Verify size and digest, then hand the payload to the task's owner to fold.
        The owner discards the spool file once it no longer needs it."""
        owner = self.task.owner
        assert owner is not None
        try:
            payload = self.spool.finish()
        except MessageRejectedError as exc:
            refused = self._refused(exc)
            self.abandon()
            raise refused from None
        except BaseException:
            self.abandon()
            raise
        self._done = True
        self.task.in_flight = False
        await owner.fold(self, payload)

    def abandon(self) -> None:
        """Drop what arrived (a broken stream; the client may push again), or a refused
        compressed stream (`refusal`: the owner fails the task). Idempotent, and nothing
        once `finish` has begun the fold."""
        if self._done:
            return
        self._done = True
        self.spool.discard()
        self.task.in_flight = False
        if self.task.owner is not None:
            self.task.owner.abandoned(self)
