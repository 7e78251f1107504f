"""Hypothesis against a live server over loopback gRPC: malformed protobuf bytes sent
raw, random sequences of RPCs, truncated and reordered chunk streams, oversize
messages. Each gets a clear status, nothing hangs, and the server then still runs a
round with honest clients. Bounded for CI; ``benchmarks/fuzz.py`` runs it longer."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fuzz_server_targets import (
    MAX_MESSAGE_BYTES,
    SessionRunner,
    cancelled_upload,
    fuzz_weights,
    raw_calls,
    run_raw_call,
    sessions,
)
from fuzz_wire import RawClient
from helpers import ScriptedClient, run_clients
from hypothesis import HealthCheck, given, settings

from fedloom import ServerConfig
from fedloom.config import TransferConfig
from fedloom.server import Server, ServerHandle

EXAMPLES = int(os.environ.get("FEDLOOM_FUZZ_EXAMPLES", "30"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def fuzz_server_config(state_dir: Path) -> ServerConfig:
    return ServerConfig(
        address="127.0.0.1:0",
        num_rounds=100_000,  # rounds keep coming while the fuzzers play
        min_clients=1,
        min_fit_clients=1,
        fraction_evaluate=0.0,
        round_timeout_s=1.0,
        long_poll_s=0.3,
        heartbeat_interval_s=0.5,
        client_timeout_s=3.0,
        stream_timeout_s=3.0,
        state_dir=str(state_dir),
        progress=False,
        quarantine_after=0,  # fuzz clients would quarantine themselves; see test_quarantine
        transfer=TransferConfig(chunk_size=1024, max_message_bytes=MAX_MESSAGE_BYTES),
        insecure=True,
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    handle = Server(
        fuzz_server_config(tmp_path_factory.mktemp("fuzz") / "state"),
        initial_weights=fuzz_weights(),
    ).start()
    yield handle
    handle.stop()
    handle.wait(15)


@FUZZ
@given(raw_calls())
def test_raw_bytes_to_any_method_get_a_clear_status(server, call) -> None:  # type: ignore[no-untyped-def]
    client = _raw_client(server)
    method, parts = call
    run_raw_call(client, method, parts)


_clients: dict[int, RawClient] = {}


def _raw_client(server: ServerHandle) -> RawClient:
    # One channel for the raw calls (its session is irrelevant: bytes carry their own).
    if server.port not in _clients:
        _clients[server.port] = RawClient(server.address, name="raw-bytes")
    return _clients[server.port]


@FUZZ
@given(sessions())
def test_random_sessions_of_calls_get_clear_statuses(server, actions) -> None:  # type: ignore[no-untyped-def]
    runner = SessionRunner(server.address)
    try:
        runner.play(actions)
    finally:
        runner.close()


def test_uploads_cancelled_mid_stream_are_released(server) -> None:  # type: ignore[no-untyped-def]
    for _ in range(3):
        cancelled_upload(server.address)


def test_the_server_still_runs_a_round_after_the_fuzzing(server) -> None:  # type: ignore[no-untyped-def]
    # Runs last in this module (pytest keeps file order).
    coordinator = server.server.coordinator
    assert coordinator is not None and server.thread.is_alive()
    seen = len(coordinator.history)
    clients = [ScriptedClient(seed=i, num_examples=3) for i in range(2)]
    stop = threading.Event()
    threads = run_clients(server.address, [*clients], stop=stop)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        honest = [r for r in coordinator.history[seen:] if r.num_updates >= 1]
        if honest and all(c.sent for c in clients):
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"no round took an honest update: {coordinator.history[seen:]}")
    assert honest[-1].status == "ok"
    stop.set()
    server.stop()
    server.wait(15)
    for t in threads:
        t.join(10)
