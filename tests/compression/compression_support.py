"""Helpers of the compression tests: client threads with their own codec settings, and a
record of every update the SDK encoded (so a test can compute, with the kernel's
`decode`, exactly what the server should have aggregated)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import committed_models

from fedloom import Weights
from fedloom.client_sdk import Client, start_client
from fedloom.client_sdk import _compression as client_compression
from fedloom.client_sdk.connection import Connection
from fedloom.compression import Codec
from fedloom.config import ClientConfig
from fedloom.messages import PROTOCOL_VERSION, JoinReply, JoinRequest, NoTask, TaskHeader
from fedloom.server.fleet import Fleet
from fedloom.types import TaskKind


@dataclasses.dataclass
class Encoded:
    """One update the SDK encoded: by which client thread, from what delta, into what."""

    client: str
    codec: Codec
    delta: Weights
    encoded: Weights


class EncodeLog:
    """Records every `encode` call of the client SDK (threads name their client)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entries: list[Encoded] = []
        self._lock = threading.Lock()
        real = client_compression.encode

        def recording(codec: Codec, delta: Weights, rng: np.random.Generator) -> Weights:
            encoded = real(codec, delta, rng)
            with self._lock:
                self.entries.append(Encoded(threading.current_thread().name, codec,
                                            delta.copy(), encoded))
            return encoded

        monkeypatch.setattr(client_compression, "encode", recording)

    def of(self, client: str) -> list[Encoded]:
        with self._lock:
            return [e for e in self.entries if e.client == client]


def client_config(address: str, **settings: Any) -> ClientConfig:
    return ClientConfig(server_address=address, rpc_timeout_s=10.0, reconnect_initial_s=0.05,
                        reconnect_max_s=0.5, insecure=True, **settings)


@contextmanager
def client_threads(address: str, clients: dict[str, tuple[Client, dict[str, Any]]],
                   stops: dict[str, threading.Event] | None = None
                   ) -> Iterator[dict[str, threading.Event]]:
    """Run each client (name -> (client, ClientConfig settings)) in a thread named after
    it, stopped by its event in ``stops`` (made when not given); yields the stop events,
    and stops and joins the threads on the way out."""
    stops = {**{name: threading.Event() for name in clients}, **(stops or {})}
    threads = []
    for name, (client, settings) in clients.items():
        thread = threading.Thread(
            target=start_client, args=(address, client), name=name, daemon=True,
            kwargs={"name": name, "config": client_config(address, **settings),
                    "handle_signals": False, "stop": stops[name], "log_to_console": False})
        thread.start()
        threads.append(thread)
    try:
        yield stops
    finally:
        for stop in stops.values():
            stop.set()
        for thread in threads:
            thread.join(15)


def rounds_committed(state_dir: str | Path) -> dict[int, Weights]:
    """Every committed round's model of the newest run, by round (0: the initial one)."""
    return committed_models(state_dir)


def joined(address: str, cases: dict[str, tuple[Any, ...]], **settings: Any
           ) -> dict[str, Connection]:
    """A joined `Connection` per case, asking for the codecs its first item names."""
    connections = {}
    for name, (asked, *_rest) in cases.items():
        connection = Connection(client_config(address, upload_codecs=asked, **settings))
        connection.join(name)
        connections[name] = connection
    return connections


def next_fit_task(connection: Connection) -> TaskHeader:
    """The connection's next task, heartbeating while there is none: a fit task."""
    outcome = connection.pull()
    while isinstance(outcome, NoTask):
        connection.heartbeat()
        outcome = connection.pull()
    task, _ = outcome
    assert task.kind is TaskKind.FIT and connection.session is not None
    return task


def join_fleet(fleet: Fleet, upload: tuple[str, ...] = (), download: tuple[str, ...] = ()
               ) -> JoinReply:
    """Join ``fleet`` asking for these codecs; the session's record holds the grants
    the reply states."""
    request = JoinRequest(PROTOCOL_VERSION, frozenset({"fit"}), "site", "", upload, download)
    reply = fleet.join(request)
    record = fleet.registry.get(reply.session.client_id)
    assert record is not None
    assert (record.upload_codec, record.download_codec, record.upload_zstd,
            record.download_zstd) == (reply.upload_codec, reply.download_codec,
                                      reply.upload_zstd, reply.download_zstd)
    return reply
