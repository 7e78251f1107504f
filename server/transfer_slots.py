"""Turns for moving models, so the server's memory stays flat in the number of clients.

Every model download (Pull) and upload (Push) that is streaming holds gRPC and protobuf
buffers of a few chunks; with 50 clients pulling or pushing at once that was hundreds
of MB on the server. `TransferSlots` lets at most ``limit`` downloads and ``limit``
uploads stream at a time; a few streams already keep the server's cores busy, so the
round is no slower.

- A download that finds no free turn within the long-poll time is answered "no task
  yet, ask again" (the client re-polls at once and gets the same task): a client never
  waits silently past its own long-poll deadline.
- A stream that holds a turn must keep moving: `IdleLimit` cuts it when no chunk has
  gone out or come in for ``chunk_timeout_s``, so a client that stops reading its
  model, or stops sending its update, cannot keep the turn from others for the whole
  stream time limit.
- A model small enough for one chunk (the secure-aggregation stages' tasks, tiny
  models) needs no turn: it costs no more than any other message.
- An upload waits for its turn with its stream open and idle before its first chunk
  (HTTP/2 flow control holds the client's data back); its stream time limit
  (``stream_timeout_s``) and the client's deadline count the wait. Uploads are served
  first come, first served, so when a round's uploads cannot all finish within the
  clients' deadlines, the first ones still do (sharing the bandwidth among all of them
  would have made every one late).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import types
from collections.abc import AsyncIterator

#: Downloads and uploads streaming at once (each); more wait for a turn.
DEFAULT_LIMIT = max(2, (os.cpu_count() or 2) // 2)


class TransferSlots:
    """Two FIFO semaphores: one for downloads, one for uploads. Transfers of at most
    ``free_bytes`` (one chunk) take no turn."""

    def __init__(self, limit: int = DEFAULT_LIMIT, *, free_bytes: int = 0) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = limit
        self.free_bytes = free_bytes
        self._downloads = asyncio.Semaphore(limit)
        self._uploads = asyncio.Semaphore(limit)

    @contextlib.asynccontextmanager
    async def download(self, wait_s: float, nbytes: int) -> AsyncIterator[bool]:
        """Hold a download turn (yields True), or yield False if none came in time."""
        if nbytes <= self.free_bytes:
            yield True
            return
        try:
            async with asyncio.timeout(wait_s):
                await self._downloads.acquire()
        except TimeoutError:
            yield False
            return
        try:
            yield True
        finally:
            self._downloads.release()

    @contextlib.asynccontextmanager
    async def upload(self, nbytes: int) -> AsyncIterator[None]:
        """Hold an upload turn, waiting as long as it takes (the caller's time limit)."""
        if nbytes <= self.free_bytes:
            yield
            return
        async with self._uploads:
            yield


class IdleLimit:
    """An async time limit that starts again whenever the stream moves (`moved`)."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._timeout: asyncio.Timeout | None = None

    async def __aenter__(self) -> IdleLimit:
        self._timeout = asyncio.timeout(self.limit_s)
        await self._timeout.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        assert self._timeout is not None
        await self._timeout.__aexit__(exc_type, exc, tb)  # raises TimeoutError when it cut

    def moved(self) -> None:
        """A chunk went out or came in: the limit counts from now."""
        assert self._timeout is not None
        self._timeout.reschedule(asyncio.get_running_loop().time() + self.limit_s)

    def expired(self) -> bool:
        """True when this limit (not an outer one) cut the stream."""
        return self._timeout is not None and self._timeout.expired()
