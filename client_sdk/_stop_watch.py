"""`StopWatch`: bounds how long a stopping client may still take.

A stop (SIGTERM, SIGINT, `ClientRunner.request_stop`, or the application setting the
``stop`` event) lets the task in progress finish and its result go out, then leaves.
Against a server that has frozen mid-call, that push (or a join) would run to its
``rpc_timeout_s`` and the Leave after it to its own, longer than a platform's grace
period before it kills the process (Kubernetes: 30 s). The watch cancels the wait for a
task as soon as the stop is seen, and once ``stop_timeout_s`` has passed, every call still
in flight (`Connection.cut_calls`): the Leave then gets at most
`fedloom.client_sdk.connection.LEAVE_TIMEOUT_S` of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from fedloom.client_sdk.connection import Connection

log = logging.getLogger("fedloom.client")

#: How often the watch looks at the stop event (it has no callbacks).
POLL_S = 0.1


class StopWatch:
    """Watches ``stop`` from a thread until closed; see the module docstring.

    Args:
        stop: the runner's stop event.
        connection: the runner's current connection (None between connections).
        timeout_s: the grace of calls in flight once ``stop`` is set.
        aborted: set by `ClientRunner.abort`, which closes the connection itself.
    """

    def __init__(self, stop: threading.Event, connection: Callable[[], Connection | None],
                 timeout_s: float, aborted: threading.Event) -> None:
        self._stop, self._connection, self._timeout_s = stop, connection, timeout_s
        self._aborted = aborted
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fedloom-stop")
        self._thread.start()

    def close(self) -> None:
        """The loop is over: the watch ends now, and is waited for. (A daemon thread
        still running when the process exits is killed mid-call; with the C++ runtimes
        of gRPC and torch loaded that can abort the exit: "terminate called without an
        active exception".)"""
        self._done.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(1.0)

    def _run(self) -> None:
        # It waits on its own event (set by `close` at once) and looks at the stop
        # event, which has no callbacks, between waits.
        while not self._stop.is_set():
            if self._done.wait(POLL_S):
                return
        deadline = time.monotonic() + self._timeout_s
        # A wait for a task ends now, not at its long poll; and again at every poll: a
        # pull that registered its call just after the stop was set is cancelled too.
        wait = 0.0  # the first look at once, then every POLL_S
        while not self._done.wait(wait):
            wait = POLL_S
            if self._aborted.is_set():
                return  # abort() closed the connection itself: nothing to bound
            connection = self._connection()
            if time.monotonic() < deadline:
                if connection is not None:
                    connection.cancel_active()
                continue
            if connection is not None:
                log.warning("still stopping after stop_timeout_s (%g s): cancelling the calls "
                            "in flight; a result not yet sent is dropped", self._timeout_s)
                connection.cut_calls()
            return
