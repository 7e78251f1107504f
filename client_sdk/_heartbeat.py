"""The heartbeat thread of a client session: tells the server, every interval, that
this client is alive while it trains or waits for a task."""

from __future__ import annotations

import logging
import threading

from fedloom.client_sdk.connection import Connection
from fedloom.errors import TransportError

log = logging.getLogger("fedloom.client")


class Heartbeat:
    """Sends heartbeats on ``connection`` until closed or ``stop`` is set."""

    def __init__(self, connection: Connection, interval_s: float, stop: threading.Event) -> None:
        self._connection, self._interval, self._stop = connection, interval_s, stop
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fedloom-heartbeat")
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self._interval) and not self._stop.is_set():
            try:
                self._connection.heartbeat()
            except TransportError as exc:
                log.debug("heartbeat failed: %s", exc)

    def close(self) -> None:
        self._done.set()
