"""Small uploads held in memory, within one byte budget for the whole server.

A spool file costs a small update more than its bytes do: creating, writing and
removing it was a tenth of the event loop's time in a round of 1,000 clients with 4 kB
updates (benchmarks/README.md, load section). So an upload whose first chunk carries
its whole payload, of at most `MAX_HELD_BYTES`, is received into memory instead
(`HeldPayload`, a sink of `fedloom.payload.PayloadReceiver`: the same checks as a
file's), as long as the server's `BUDGET_BYTES` allows; any other upload, and a small
one that finds the budget spent, is spooled to a file as before
(`fedloom.server.uploads.Spool`).

Accounting: `UploadMemory.hold` reserves the payload's declared size (the header's
``total_bytes``, past which the receiver refuses any byte) when the first chunk
arrives, before it is stored, and the reservation is returned exactly once:

- by `HeldPayload.release`, when the upload is discarded: refused (digest, size,
  content, codec), cancelled, cut by a time limit, or dropped by the task's owner
  (the round closed, the update failed its decode check);
- otherwise when the last reference to its bytes goes: the strategy has folded the
  update and let it go, or the round that held it ended (`__del__`; the budget is
  thread-safe, since the aggregation thread drops most of them).

So the payload bytes held never exceed the budget. Limits: the budget belongs to the process
(one server per process, as `fedloom.server.memory` assumes too; servers sharing a
process share it). A strategy that keeps every update until its round ends (a robust
rule) keeps their reservations until then, and later uploads go to files.
"""

from __future__ import annotations

import threading

from fedloom.payload import PayloadInfo

#: Largest payload held in memory (bytes): a larger one is spooled to a file.
MAX_HELD_BYTES = 64 * 1024
#: Most payload bytes the server holds in memory at once, over all its uploads.
BUDGET_BYTES = 64 * 1024 * 1024


class UploadMemory:
    """The server's budget for uploads held in memory (see the module docstring).

    Args:
        budget_bytes: most payload bytes held at once (0: every upload is spooled).
        max_upload_bytes: largest payload held; larger ones are spooled.
    """

    def __init__(self, budget_bytes: int = BUDGET_BYTES,
                 max_upload_bytes: int = MAX_HELD_BYTES) -> None:
        if budget_bytes < 0 or max_upload_bytes < 0:
            raise ValueError(f"budget_bytes ({budget_bytes}) and max_upload_bytes "
                             f"({max_upload_bytes}) must be >= 0")
        self.budget_bytes = budget_bytes
        self.max_upload_bytes = max_upload_bytes
        self._lock = threading.Lock()
        self._in_use = 0

    @property
    def in_use(self) -> int:
        """Payload bytes reserved now (held, or announced and still arriving)."""
        with self._lock:
            return self._in_use

    def may_hold(self, info: PayloadInfo, max_chunk_bytes: int) -> bool:
        """Whether the payload ``info`` announces is small enough to be held: at most
        ``max_upload_bytes``, in one chunk of at most ``max_chunk_bytes``."""
        return info.total_bytes <= self.max_upload_bytes and info.wire_size <= max_chunk_bytes

    def hold(self, info: PayloadInfo, max_chunk_bytes: int) -> HeldPayload | None:
        """Memory for the payload ``info`` announces; None when it must be spooled to a
        file instead: too large (`may_hold`), or more than the budget has left."""
        if not self.may_hold(info, max_chunk_bytes):
            return None
        nbytes = info.total_bytes
        with self._lock:
            if self._in_use + nbytes > self.budget_bytes:
                return None
            self._in_use += nbytes
        return HeldPayload(self, nbytes)

    def _give_back(self, nbytes: int) -> None:
        with self._lock:
            self._in_use -= nbytes


class HeldPayload:
    """One upload's payload in memory (a `fedloom.payload.Sink`), under a reservation
    of ``nbytes`` of its `UploadMemory`."""

    __slots__ = ("_data", "_memory", "nbytes")

    def __init__(self, memory: UploadMemory, nbytes: int) -> None:
        self._data = bytearray()
        self._memory: UploadMemory | None = memory
        self.nbytes = nbytes

    def write(self, data: bytes | memoryview) -> None:
        self._data += data

    def view(self) -> memoryview:
        """The bytes received, read-only (empty once released)."""
        return memoryview(self._data).toreadonly()

    def release(self) -> None:
        """Drop the bytes and return the reservation; later calls do nothing."""
        memory, self._memory = self._memory, None
        self._data = bytearray()
        if memory is not None:
            memory._give_back(self.nbytes)

    def __del__(self) -> None:
        self.release()


#: The budget of this process's server (replace it before the server starts to change
#: it: `fedloom.server.uploads.Spool` looks it up for each upload).
UPLOAD_MEMORY = UploadMemory()
