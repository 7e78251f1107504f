"""A server stopped mid-round (SIGTERM, `ServerHandle.stop`) leaves no error behind.

Regression for issue 20, item 7: the plain driver cancelled its round without ever
retrieving the aggregation future, whose `RoundAbortedError` asyncio then logged as
"Future exception was never retrieved" when the future was collected.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
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
    # The defect: an exception set on a future nobody awaited; and no task (an RPC's
    # included) may be left pending when the server's loop closes.
    unretrieved = [r.getMessage() for r in caplog.records if r.name == "asyncio"
                   and ("exception was never retrieved" in r.getMessage()
                        or "destroyed but it is pending" in r.getMessage())]
    assert not unretrieved, unretrieved


def test_a_plain_round_stopped_mid_fit_logs_no_unretrieved_exception(
        server_config, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    _stop_mid_fit(server_config, caplog)


def test_a_secure_round_stopped_mid_fit_logs_no_unretrieved_exception(
        server_config, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    secure = SecAggConfig(enabled=True, neighbours=2, threshold=2, max_weight=100.0,
                          max_participants=64, bits=24, allow_unauthenticated=True)
    _stop_mid_fit(server_config, caplog, secure_aggregation=secure)


def test_a_stopped_server_cancels_what_is_still_scheduled_on_its_loop(
        server_config, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    # A task still pending when serve() returns (as the last step of an RPC that gRPC's
    # stop cut short can be) is cancelled and awaited before the loop closes, instead
    # of being destroyed pending when it is collected ("Task was destroyed but it is
    # pending!", which a server stopped under an upload in flight used to log).
    gc.collect()
    handle = Server(server_config(num_rounds=2, fraction_evaluate=0.0),
                    initial_weights=tiny_weights()).start()
    loop = handle._loop
    assert loop is not None
    made: concurrent.futures.Future[asyncio.Task[None]] = concurrent.futures.Future()

    async def forever() -> None:
        await asyncio.Event().wait()

    loop.call_soon_threadsafe(lambda: made.set_result(loop.create_task(forever())))
    straggler = made.result(10)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        handle.stop()
        handle.wait(15)
        assert loop.is_closed() and straggler.cancelled()
        del straggler
        gc.collect()
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]
