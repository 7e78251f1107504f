"""Uploads spooled to disk, so the server's memory does not grow with the clients.

`Spool` receives one upload's chunks into a file under the server's spool folder via
the kernel's `PayloadReceiver` (order, sizes, digest, finite values checked as bytes
arrive). Once whole and verified it becomes `SpooledWeights`: a `Weights` that reads
each tensor from the file only when an aggregator asks for it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from fedloom.payload import PayloadInfo, PayloadReceiver
from fedloom.weights import TensorSpec, Weights


class SpooledWeights(Weights):
    """Read-only `Weights` backed by a verified spool file; tensors load on access."""

    __slots__ = ("_offsets", "_path", "_specs")

    def __init__(self, path: Path, specs: tuple[TensorSpec, ...]) -> None:
        super().__init__()
        self._path = path
        self._specs = specs
        offsets, pos = {}, 0
        for spec in specs:
            offsets[spec.name] = (pos, spec)
            pos += spec.nbytes
        self._offsets = offsets

    def __getitem__(self, name: str) -> np.ndarray:
        offset, spec = self._offsets[name]
        with open(self._path, "rb") as fh:
            fh.seek(offset)
            arr = np.fromfile(fh, dtype=spec.numpy_dtype, count=spec.size)
        if arr.size != spec.size:
            raise OSError(f"spool file {self._path} is shorter than its layout")
        arr = arr.reshape(spec.shape)
        arr.flags.writeable = False
        return arr

    def __iter__(self) -> Iterator[str]:
        return iter(self._offsets)

    def __len__(self) -> int:
        return len(self._offsets)

    def specs(self) -> tuple[TensorSpec, ...]:
        return self._specs


class Spool:
    """One upload in progress: chunks go to a temp file; `finish` verifies it."""

    def __init__(self, folder: Path, info: PayloadInfo, max_chunk_bytes: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="upload-", suffix=".bin", dir=folder)
        self.path = Path(name)
        self._file = os.fdopen(fd, "wb", buffering=1 << 20)
        self._info = info
        self._receiver = PayloadReceiver(
            info.specs,
            info.total_bytes,
            info.sha256,
            self._file,
            max_chunk_bytes=max_chunk_bytes,
        )

    def feed(self, offset: int, data: bytes) -> None:
        self._receiver.feed(offset, data)

    def finish(self) -> SpooledWeights:
        """Verify size and digest; the file then backs a `SpooledWeights`."""
        self._file.close()
        self._receiver.finish()
        return SpooledWeights(self.path, self._info.specs)

    def discard(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.path.unlink(missing_ok=True)
