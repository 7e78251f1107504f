"""Turns for moving models, so the server's memory stays flat in the number of clients.

Every model download (Pull) and upload (Push) that is streaming holds gRPC and protobuf
buffers of a few chunks; with 50 clients pulling or pushing at once that was hundreds
of MB on the server. `TransferSlots` lets at most ``limit`` downloads and ``limit``
uploads stream at a time; a few streams already keep the server's cores busy, so the
round is no slower.

- A download that finds no free turn within the long-poll time is answered "no task
  yet, ask again" (the client re-polls at once and gets the same task): a client never
  waits silently past its own long-poll deadline.
- A stream that holds a turn must keep moving, fast enough: `TransferPace` cuts it
  when no chunk has gone out or come in for ``chunk_timeout_s``, or when it falls
  behind ``min_transfer_rate`` by more than ``transfer_window_s``; so it holds its turn
  for at most ``transfer_window_s + size / min_transfer_rate``. A client that stops
  reading its model, or trickles its update, cannot keep the turn from others for the
  whole stream time limit (and the cut counts against it: `fedloom.server.quarantine`).
- A model small enough for one chunk (the secure-aggregation stages' tasks, tiny
  models) needs no turn: it costs no more than any other message.
- An upload takes its turn at its first chunk, not at its header: a client that sends a
  header and then nothing holds no turn. Its first chunk is written to its spool,
  then it waits for its turn with its stream open (HTTP/2 flow control holds the rest
  back); its stream time limit (``stream_timeout_s``) and the client's deadline count the
  wait. Uploads are served first come, first served, so when a round's uploads cannot
  all finish within the clients' deadlines, the first ones still do (sharing the
  bandwidth among all of them would have made every one late).
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


class TransferPace:
    """The limits of a stream that holds a transfer turn (see the module docstring).

    An async context that raises `TimeoutError` out of its block, as `asyncio.timeout`
    does, at the first of:

    - **idle**: no chunk `moved` for ``idle_s`` (``chunk_timeout_s``);
    - **rate**: the next chunk is due by ``start + window_s + (moved + chunk) /
      min_rate``: the stream may lag the minimum rate by one window (plus the chunk in
      flight, since bytes move a chunk at a time), and so it ends by ``start +
      window_s + size / min_rate`` whatever it does. ``min_rate`` 0: no rate limit.

    `limit` then says which one cut it. The clock starts when the block is entered
    (the turn is taken), not when the stream opened.
    """

    def __init__(self, idle_s: float, *, min_rate: float = 0.0, window_s: float = 0.0,
                 size: int = 0, chunk: int = 1) -> None:
        self.idle_s = idle_s
        self.min_rate = min_rate
        self.window_s = window_s
        self.size = size
        self.chunk = chunk
        self.moved_bytes = 0
        self.limit = "idle"  # the limit that falls due first: "idle" or "rate"
        self._start = 0.0
        self._timeout: asyncio.Timeout | None = None

    async def __aenter__(self) -> TransferPace:
        loop = asyncio.get_running_loop()
        self._start = loop.time()
        self._timeout = asyncio.timeout_at(self._due(self._start))
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

    def moved(self, nbytes: int) -> None:
        """``nbytes`` went out or came in: the limits count from here."""
        assert self._timeout is not None
        self.moved_bytes += nbytes
        self._timeout.reschedule(self._due(asyncio.get_running_loop().time()))

    def _due(self, now: float) -> float:
        idle = now + self.idle_s
        if self.min_rate <= 0:
            self.limit = "idle"
            return idle
        owed = min(self.moved_bytes + self.chunk, self.size)
        rate = self._start + self.window_s + owed / self.min_rate
        self.limit = "idle" if idle <= rate else "rate"
        return min(idle, rate)

    def elapsed_s(self) -> float:
        return asyncio.get_running_loop().time() - self._start

    def expired(self) -> bool:
        """True when this pace (not an outer limit) cut the stream."""
        return self._timeout is not None and self._timeout.expired()
