"""Clients come back to a restarted server within the SDK's own backoff.

gRPC keeps reconnect backoff in subchannels that, by default, every channel to the
same address in the process shares; the SDK opens a fresh channel per reconnect, but a
fresh channel inherited the grown backoff (1 s, 1.6 s, 2.6 s, ... up to 2 min), so after
an outage clients stayed away long after the server was back. The SDK now keeps
subchannels per channel and bounds gRPC's backoff by ``reconnect_max_s``.

The fix is checked by counting connection attempts, not by timing a rejoin: a stand-in
for the down server (`RefusingListener`) accepts each TCP connection and closes it at
once, so every attempt is seen and fails like a connection to a server that is not
there. With a shared subchannel, a fresh `Connection` made while an earlier one to the
same address backs off makes no attempt at all: its first call fails at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from outage import RefusingListener
from recovery_support import ClientPool, free_port, initial_weights, run_settings, server_config

from fedloom.client_sdk import Client, ClientRunner, EvaluateOutput, FitOutput
from fedloom.client_sdk.connection import Connection
from fedloom.config import ClientConfig
from fedloom.errors import TransportError
from fedloom.server import Server


@pytest.fixture
def listener() -> Iterator[RefusingListener]:
    down = RefusingListener()
    yield down
    down.close()


def _config(address: str, **overrides: float) -> ClientConfig:
    return ClientConfig(server_address=address, rpc_timeout_s=5.0, insecure=True,
                        **overrides)  # type: ignore[arg-type]


def test_a_fresh_connection_tries_the_network_while_an_earlier_one_backs_off(
    listener: RefusingListener,
) -> None:
    # Backoff far beyond the test: an attempt now can only come from a fresh channel.
    config = _config(listener.address, reconnect_initial_s=60.0, reconnect_max_s=60.0)
    connections = []
    try:
        for expected in (1, 2, 3):
            connection = Connection(config)
            connections.append(connection)  # kept open: its channel is backing off
            with pytest.raises(TransportError):
                connection.join("site")
            assert listener.attempts == expected
    finally:
        for connection in connections:
            connection.close()


class _Idle(Client):
    def fit(self, weights, config):  # type: ignore[no-untyped-def]
        return FitOutput(weights, 1, {})

    def evaluate(self, weights, config):  # type: ignore[no-untyped-def]
        return EvaluateOutput(0.0, 1, {})


def test_each_reconnect_of_the_runner_is_a_connection_attempt(
    listener: RefusingListener,
) -> None:
    """While the server is away, every join the runner makes reaches the network: a
    client is back at its first attempt after the server is."""
    limit = 5
    config = _config(listener.address, reconnect_initial_s=0.01, reconnect_max_s=0.02,
                     max_reconnect_attempts=limit)
    runner = ClientRunner(_Idle(), config)
    with pytest.raises(TransportError, match=f"gave up after {limit} reconnect attempts"):
        runner.run()
    assert runner.stats.reconnects == limit
    assert listener.attempts >= limit + 1  # the first join and one per reconnect


def test_clients_rejoin_a_restarted_server_after_an_outage(tmp_path: Path) -> None:
    port = free_port()
    config = server_config(run_settings(tmp_path / "state", port, num_rounds=1))
    first = Server(config, initial_weights=initial_weights()).start()
    first.stop()
    first.wait(10)
    down = RefusingListener(port)  # the outage: every client keeps failing to connect
    pool = ClientPool(f"127.0.0.1:{port}")  # reconnect_max_s = 0.3
    try:
        # Several failed attempts per client, as an outage leaves them (not a duration).
        assert down.wait_for(4 * len(pool.clients), timeout_s=30)
        down.close()
        second = Server(config, initial_weights=initial_weights()).start()
        history = second.wait(30)
        pool.join(10)
    finally:
        pool.stop.set()
    assert [r.status for r in history] == ["ok"]
    assert all(c.rounds == [1] for c in pool.clients)

