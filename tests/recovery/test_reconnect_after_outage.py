"""Clients come back to a restarted server within the SDK's own backoff.

gRPC keeps reconnect backoff in subchannels that, by default, every channel to the
same address in the process shares; the SDK opens a fresh channel per reconnect, but a
fresh channel inherited the grown backoff (1 s, 1.6 s, 2.6 s, ... up to 2 min), so after
an outage clients stayed away long after the server was back. The SDK now keeps
subchannels per channel and bounds gRPC's backoff by ``reconnect_max_s``.
"""

from __future__ import annotations

import time
from pathlib import Path

from recovery_support import ClientPool, free_port, initial_weights, run_settings, server_config

from fedloom.server import Server


def test_clients_rejoin_a_restarted_server_promptly_after_an_outage(tmp_path: Path) -> None:
    port = free_port()
    config = server_config(run_settings(tmp_path / "state", port, num_rounds=1))
    first = Server(config, initial_weights=initial_weights()).start()
    first.stop()
    first.wait(10)
    pool = ClientPool(f"127.0.0.1:{port}")  # reconnect_max_s = 0.3
    try:
        time.sleep(8.0)  # the server is down; clients keep failing to connect
        second = Server(config, initial_weights=initial_weights()).start()
        coordinator = second.server.coordinator
        assert coordinator is not None
        back = time.monotonic()
        while len(coordinator.registry) < len(pool.clients) and time.monotonic() - back < 30:
            time.sleep(0.01)
        elapsed = time.monotonic() - back
        history = second.wait(30)
        pool.join(10)
    finally:
        pool.stop.set()
    assert elapsed < 2.0, f"clients took {elapsed:.2f} s to rejoin"
    assert [r.status for r in history] == ["ok"]
