"""A stand-in for a server that is down, which counts the clients' attempts to reach it."""

from __future__ import annotations

import contextlib
import socket
import threading


class RefusingListener:
    """Listens on a port, counts each connection it accepts and closes it at once."""

    def __init__(self, port: int = 0) -> None:
        self._socket = socket.socket()
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", port))
        self._socket.listen(64)
        self.port = int(self._socket.getsockname()[1])
        self.address = f"127.0.0.1:{self.port}"
        self.attempts = 0
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:  # closed
                return
            with self._changed:  # counted before the client can see the failure
                self.attempts += 1
                self._changed.notify_all()
            connection.close()

    def wait_for(self, attempts: int, timeout_s: float) -> bool:
        """Whether ``attempts`` connections arrived within ``timeout_s``."""
        with self._changed:
            return self._changed.wait_for(lambda: self.attempts >= attempts, timeout_s)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # shutdown wakes the blocked accept()
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()
        self._thread.join(5)
