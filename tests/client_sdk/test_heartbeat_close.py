"""A heartbeat racing the session's end: the runner closes the connection while its
heartbeat thread may be just about to send, and that send must fail as a transport
error (which the thread logs, at debug level, as any failed beat), not as gRPC's
ValueError for a call on a closed channel, which escaped the thread as an unhandled
exception."""

from __future__ import annotations

import threading

import pytest
from helpers import fake_fleet_connection

from fedloom.client_sdk._heartbeat import Heartbeat
from fedloom.client_sdk.connection import Connection
from fedloom.errors import TransportError
from fedloom.messages import Session


def _joined_then_closed() -> Connection:
    connection = fake_fleet_connection("127.0.0.1:9", rpc_timeout_s=1.0)
    connection.session = Session("c1", b"s" * 32)  # as a join leaves it
    connection.close()
    return connection


def test_a_heartbeat_after_close_is_a_transport_error() -> None:
    connection = _joined_then_closed()
    with pytest.raises(TransportError, match="heartbeat: the connection is closed"):
        connection.heartbeat()


def test_the_heartbeat_thread_ends_quietly_when_its_connection_closes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The thread's beat lands after the close (the window the race leaves open).
    failures: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    beat = Heartbeat(_joined_then_closed(), 0.001, threading.Event())
    try:
        threading.Event().wait(0.05)  # dozens of beats on the closed connection
    finally:
        beat.close()
        beat._thread.join(5)
    assert not beat._thread.is_alive() and failures == []
