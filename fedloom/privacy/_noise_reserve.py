"""A client's next-round Skellam noise, drawn ahead from idle CPU time.

The noise of a distributed-DP round depends only on (μ_client, d'), which stay the same
from round to round of a run, and drawing it (two Poisson draws per coordinate) costs
more than the rest of the encoding. After each encoding the client asks for the next
round's draws (`NoiseReserve.refill`); a background thread draws them in chunks while
the client waits for the server. On Linux that thread runs at the lowest CPU priority
(nice 19), so on a busy device, or on a machine shared by many simulated clients, it
takes only time nothing else wants. When the next round arrives, `NoiseReserve.take`
draws whatever chunks are missing itself, at the caller's priority, and never waits for
the background thread: the round never waits on a starved low-priority draw.

Draws are used once, only for the same (μ, d'), and come from generators seeded by the
OS CSPRNG (one per thread: a `numpy.random.Generator` is not shared between threads).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import threading

import numpy as np

from fedloom.privacy._skellam import sample_skellam

#: Draws per chunk: at most one chunk is drawn twice (the one in flight on the
#: background thread when the caller takes over), and numpy's per-call cost stays small.
CHUNK = 1 << 16
#: The background thread's niceness (Linux only; the lowest priority).
BACKGROUND_NICE = 19


def _lower_this_threads_priority() -> None:
    """Best effort: on Linux ``setpriority`` with a thread id applies to that thread
    alone (elsewhere the id is no process id, so nothing is tried)."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError):  # not allowed: the draws happen at normal priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


class _Draws:
    """One round's noise in chunks: the background thread fills what it can until the
    caller closes the job; the caller then draws every chunk still missing itself.

    The caller never waits for the background thread: a chunk that thread is still
    drawing is drawn again, and the late copy is dropped (`_closed`, checked under the
    lock, which is only ever held for a list assignment).
    """

    def __init__(self, mu: float, length: int) -> None:
        self.key = (mu, length)
        self._chunks: list[np.ndarray | None] = [None] * -(-length // CHUNK)
        self._next = 0
        self._closed = False
        self._lock = threading.Lock()

    def _size(self, index: int) -> int:
        return min(CHUNK, self.key[1] - index * CHUNK)

    def draw_in_background(self) -> None:
        _lower_this_threads_priority()
        rng = np.random.default_rng(secrets.randbits(128))
        while True:
            with self._lock:
                if self._closed or self._next >= len(self._chunks):
                    return
                index, self._next = self._next, self._next + 1
            chunk = sample_skellam(self.key[0], self._size(index), rng)
            with self._lock:
                if self._closed:
                    return
                self._chunks[index] = chunk

    def finish(self) -> np.ndarray:
        """Close the job, draw the missing chunks here; all the values, int64."""
        with self._lock:
            self._closed = True
        rng = np.random.default_rng(secrets.randbits(128))
        chunks = [chunk if chunk is not None else sample_skellam(self.key[0], self._size(i), rng)
                  for i, chunk in enumerate(self._chunks)]
        return np.concatenate(chunks) if chunks else np.empty(0, np.int64)

    def cancel(self) -> None:
        with self._lock:
            self._closed = True


class NoiseReserve:
    """One round's Skellam noise, drawn ahead (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._draws: _Draws | None = None

    def take(self, mu: float, length: int) -> np.ndarray | None:
        """The reserved draws for ``(mu, length)``, completed here if need be; or None
        when nothing was reserved for that shape (the caller draws its own)."""
        with self._lock:
            draws, self._draws = self._draws, None
        if draws is None:
            return None
        if draws.key != (mu, length):
            draws.cancel()
            return None
        return draws.finish()

    def refill(self, mu: float, length: int) -> None:
        """Start drawing ``length`` values of ``Sk(mu)`` for the next round."""
        draws = _Draws(mu, length)
        with self._lock:
            previous, self._draws = self._draws, draws
        if previous is not None:
            previous.cancel()
        threading.Thread(target=draws.draw_in_background, name="fedloom-noise",
                         daemon=True).start()
