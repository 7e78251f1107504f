"""`Watchdog`: cancels a streaming gRPC call that has received nothing for too long."""

from __future__ import annotations

import threading
import time
from typing import Any


class Watchdog:
    """Cancels the connection's armed streaming call once it receives nothing for
    ``idle_s`` seconds.

    One thread per connection, started on first use and kept between calls: starting a
    thread per Pull cost a thread start (and, on a busy machine, a wait for it to be
    scheduled) on every task, four times per secure round.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._call: Any = None
        self._last = 0.0
        self.idle_s = 0.0
        self.fired = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self, call: Any, idle_s: float) -> None:
        """Watch ``call`` from now on (replacing any call watched before)."""
        with self._lock:
            self._call, self.idle_s, self.fired = call, idle_s, False
            self._last = time.monotonic()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="fedloom-watchdog")
            self._thread.start()

    def touch(self) -> None:
        self._last = time.monotonic()

    def disarm(self) -> None:
        with self._lock:
            self._call = None

    def close(self) -> None:
        """Stop the thread (the connection is closing)."""
        self.disarm()
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(0.25):
            with self._lock:
                call = self._call
                if call is None or time.monotonic() - self._last <= self.idle_s:
                    continue
                self.fired, self._call = True, None
            call.cancel()
