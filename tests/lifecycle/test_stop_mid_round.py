"""A server stopped mid-round (SIGTERM, `ServerHandle.stop`) leaves no error behind.

Regression for issue 20, item 7: the plain driver cancelled its round without ever
retrieving the aggregation future, whose `RoundAbortedError` asyncio then logged as
"Future exception was never retrieved" when the future was collected.
"""

from __future__ import annotations

import gc
import logging
import threading

import pytest
from lifecycle_support import ClientThreads, GatedClient, tiny_weights, wait_until

from fedloom.secagg import SecAggConfig
from fedloom.server import Server


def _stop_mid_fit(server_config, caplog: pytest.LogCaptureFixture, **overrides) -> None:  # type: ignore[no-untyped-def]
    gc.collect()  # earlier tests' garbage is reported now, not inside the window below
    gate = threading.Event()
    clients = [GatedClient(gate) for _ in range(3)]
    handle = Server(server_config(num_rounds=2, fraction_evaluate=0.0, **overrides),
                    initial_weights=tiny_weights()).start()
    pool = ClientThreads(handle.address, clients)  # type: ignore[arg-type]
    try:
        wait_until(lambda: all(c.started.is_set() for c in clients), what="every fit to start")
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            handle.stop()
            handle.wait(15)
            gc.collect()  # an unretrieved exception is reported when its future is collected
    finally:
        gate.set()
        pool.close()
    # The defect: an exception set on a future nobody awaited. (gRPC's own RPC tasks may
    # be reported "destroyed but pending" when the loop closes under an upload in
    # flight; that is the transport's shutdown, not an unretrieved error.)
    unretrieved = [r.getMessage() for r in caplog.records if r.name == "asyncio"
                   and "exception was never retrieved" in r.getMessage()]
    assert not unretrieved, unretrieved


def test_a_plain_round_stopped_mid_fit_logs_no_unretrieved_exception(
        server_config, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    _stop_mid_fit(server_config, caplog)


def test_a_secure_round_stopped_mid_fit_logs_no_unretrieved_exception(
        server_config, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    secure = SecAggConfig(enabled=True, neighbours=2, threshold=2, max_weight=100.0,
                          max_participants=64, bits=24, allow_unauthenticated=True)
    _stop_mid_fit(server_config, caplog, secure_aggregation=secure)
