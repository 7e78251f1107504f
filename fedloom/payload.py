"""The byte layout of `Weights` on the wire and its chunk-by-chunk verification.

A payload is the tensors' raw little-endian bytes, concatenated in order: no pickle, no
``.npy`` headers. The layout (a tuple of `TensorSpec`) travels separately in a header,
with the payload's total size and SHA-256 digest. Chunks carry an offset and bytes.

`PayloadReceiver` validates a stream of chunks as they arrive — order, sizes, the
incremental digest and (for floating tensors) finite values — and writes them to a
sink: a `bytearray` for a client receiving a model, a spool file for a server receiving
an update, so that a server's memory does not grow with the number of uploads.

`BlockSource` is what a payload held outside memory (the server's spool files) offers
to aggregators: tensors read piecewise into the caller's buffer, so an update is never
loaded whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.weights import TensorSpec, Weights

DEFAULT_CHUNK_SIZE = 1 << 20  # 1 MiB
#: The largest payload that travels inside its header ("inline" capability, see
#: `inline_limit`). Below it a payload's second message (its one Chunk) costs the server
#: more than its bytes do; above it the bytes dominate and Chunks keep messages small.
INLINE_MAX_BYTES = 32 * 1024


def inline_limit(chunk_size: int) -> int:
    """The largest payload, in wire bytes, that a peer granted the "inline" capability
    sends inside its task or result header: ``min(chunk_size, INLINE_MAX_BYTES)`` (a
    payload that would be one Chunk anyway, and small)."""
    return min(chunk_size, INLINE_MAX_BYTES)


@dataclasses.dataclass(frozen=True, slots=True)
class PayloadInfo:
    """A payload's layout, size and SHA-256 digest: what a header announces.

    ``wire_bytes`` is 0 when the chunks carry the payload itself, else the size of the
    zstd stream they carry instead (`fedloom.compression.ZstdReceiver`); the layout, size
    and digest always describe the payload once decompressed.
    """

    specs: tuple[TensorSpec, ...]
    total_bytes: int
    sha256: bytes
    wire_bytes: int = 0

    @classmethod
    def describe(cls, specs: Sequence[TensorSpec], payload: bytes | memoryview) -> PayloadInfo:
        return cls(tuple(specs), len(payload), digest(payload))

    @property
    def wire_size(self) -> int:
        """The bytes the chunks carry: the zstd stream's, or the payload's."""
        return self.wire_bytes or self.total_bytes


def payload_size(specs: Sequence[TensorSpec]) -> int:
    return sum(s.nbytes for s in specs)


def serialize(weights: Weights) -> memoryview:
    """Concatenate the tensors' bytes in order: one copy of the model, read-only."""
    flat = np.empty(weights.nbytes, dtype=np.uint8)  # every byte is written below
    pos = 0
    for arr in weights.values():
        n = arr.nbytes
        flat[pos : pos + n] = arr.reshape(-1).view(np.uint8)
        pos += n
    return flat.data.toreadonly()


def serialize_difference(new: Weights, old: Weights) -> memoryview:
    """``serialize(new.subtract(old))`` in one pass: each tensor's difference is
    written straight into the payload (no intermediate model copy)."""
    new.check_same_layout(old)
    flat = np.empty(new.nbytes, dtype=np.uint8)
    pos = 0
    for name, arr in new.items():
        n = arr.nbytes
        out = flat[pos : pos + n].view(arr.dtype).reshape(arr.shape)
        np.subtract(arr, old[name], out=out, dtype=arr.dtype)
        pos += n
    return flat.data.toreadonly()


def digest(payload: bytes | memoryview) -> bytes:
    return hashlib.sha256(payload).digest()


def deserialize(specs: Sequence[TensorSpec], payload: bytes | bytearray | memoryview) -> Weights:
    """Weights whose arrays are views into ``payload`` (no copy)."""
    expected = payload_size(specs)
    if len(payload) != expected:
        raise MessageRejectedError(
            RejectReason.INVALID, f"payload is {len(payload)} bytes, layout needs {expected}"
        )
    tensors = []
    pos = 0
    for spec in specs:
        arr = np.frombuffer(payload, dtype=spec.numpy_dtype, count=spec.size, offset=pos)
        tensors.append((spec.name, arr.reshape(spec.shape)))
        pos += spec.nbytes
    return Weights(tensors)


def iter_chunks(payload: bytes | memoryview, chunk_size: int) -> Iterator[tuple[int, bytes]]:
    """Yield ``(offset, bytes)`` pieces of at most ``chunk_size`` bytes (none for empty)."""
    for offset, view in iter_chunk_views(payload, chunk_size):
        yield offset, bytes(view)


def iter_chunk_views(
    payload: bytes | memoryview, chunk_size: int
) -> Iterator[tuple[int, memoryview]]:
    """Like `iter_chunks`, but the pieces are views into ``payload`` (no copy)."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    view = memoryview(payload).cast("B")
    for offset in range(0, len(view), chunk_size):
        yield offset, view[offset : offset + chunk_size]


class Sink(Protocol):
    def write(self, data: bytes, /) -> object: ...


class BlockReader(Protocol):
    """An open payload whose tensors are read piecewise (see `BlockSource`)."""

    def read_into(self, name: str, start: int, out: np.ndarray) -> None:
        """Fill ``out`` (1-d, the tensor's dtype) with elements ``start ..
        start + len(out)`` of tensor ``name``, flattened in C order."""

    def close(self) -> None:
        """Release the reader (its file)."""


@runtime_checkable
class BlockSource(Protocol):
    """`Weights` whose bytes live outside memory (e.g. a verified spool file).

    Aggregators that find this on an update read it block by block through
    `open_blocks` instead of loading whole tensors with ``weights[name]``.
    """

    def open_blocks(self) -> BlockReader:
        """Open for piecewise reads; the caller closes the reader."""


class PayloadReceiver:
    """Validate chunks of one payload as they arrive and pass them to a sink.

    Raises `MessageRejectedError` at the first problem: a chunk out of order, more bytes
    than the layout declares, a non-finite value in a floating tensor, or (at `finish`)
    a short payload or a digest mismatch. Nothing reaches the sink past a bad chunk.
    """

    def __init__(
        self,
        specs: Sequence[TensorSpec],
        total_bytes: int,
        sha256: bytes,
        sink: Sink,
        *,
        max_chunk_bytes: int,
        check_finite: bool = True,
    ) -> None:
        expected = payload_size(specs)
        if total_bytes != expected:
            raise MessageRejectedError(
                RejectReason.INVALID,
                f"header declares {total_bytes} bytes but its layout needs {expected}",
            )
        if len(sha256) != 32:
            raise MessageRejectedError(RejectReason.INVALID, "sha256 digest must be 32 bytes")
        self._specs = tuple(specs)
        self._ends = np.cumsum([s.nbytes for s in self._specs], dtype=np.int64)
        self._total = total_bytes
        self._expected_digest = sha256
        self._sink = sink
        self._max_chunk = max_chunk_bytes
        self._check_finite = check_finite
        self._hash = hashlib.sha256()
        self._received = 0
        self._carry = b""  # bytes of a floating element split across chunks

    @property
    def received(self) -> int:
        return self._received

    def feed(self, offset: int, data: bytes) -> None:
        if offset != self._received:
            raise MessageRejectedError(
                RejectReason.INVALID,
                f"chunk at offset {offset} arrived, expected offset {self._received}",
            )
        if len(data) == 0 or len(data) > self._max_chunk:
            raise MessageRejectedError(
                RejectReason.INVALID,
                f"chunk of {len(data)} bytes; chunks must hold 1..{self._max_chunk} bytes",
            )
        if self._received + len(data) > self._total:
            raise MessageRejectedError(
                RejectReason.INVALID,
                f"payload exceeds the {self._total} bytes its header declares",
            )
        if self._check_finite:
            self._check_chunk_finite(offset, data)
        self._hash.update(data)
        self._sink.write(data)
        self._received += len(data)

    def finish(self) -> None:
        if self._received != self._total:
            raise MessageRejectedError(
                RejectReason.INVALID,
                f"stream ended after {self._received} of {self._total} payload bytes",
            )
        if self._hash.digest() != self._expected_digest:
            raise MessageRejectedError(RejectReason.INVALID, "payload SHA-256 digest mismatch")

    def _check_chunk_finite(self, offset: int, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        end = offset + len(view)
        # First tensor that ends after `offset`.
        index = int(np.searchsorted(self._ends, offset, side="right"))
        pos = offset
        while pos < end and index < len(self._specs):
            spec = self._specs[index]
            t_end = int(self._ends[index])
            seg_end = min(end, t_end)
            if spec.numpy_dtype.kind == "f":
                self._check_segment(spec, view[pos - offset : seg_end - offset])
            pos = seg_end
            if pos == t_end:
                index += 1
                self._carry = b""

    def _check_segment(self, spec: TensorSpec, segment: memoryview) -> None:
        """Check the whole elements of one tensor's bytes in a chunk (no copy); an
        element split across chunks is carried over and checked when complete."""
        item = spec.numpy_dtype.itemsize
        if self._carry:
            need = item - len(self._carry)
            self._carry += bytes(segment[:need])
            segment = segment[need:]
            if len(self._carry) < item:
                return
            self._require_finite(spec, self._carry)
            self._carry = b""
        whole = len(segment) - len(segment) % item
        if whole:
            self._require_finite(spec, segment[:whole])
        self._carry = bytes(segment[whole:])

    @staticmethod
    def _require_finite(spec: TensorSpec, data: bytes | memoryview) -> None:
        values = np.frombuffer(data, dtype=spec.numpy_dtype)
        if not np.isfinite(values).all():
            raise MessageRejectedError(
                RejectReason.INVALID, f"tensor {spec.name!r} holds NaN or Inf"
            )
