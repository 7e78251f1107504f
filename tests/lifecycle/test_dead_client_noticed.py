"""A client whose connection closes mid-download is dropped at once (issue 20, item 6).

The server's task stream found a dead client by a cancel, but a client that died while
the server was writing its model (the write blocked on flow control) made that write
fail instead; the session then lived until ``client_timeout_s`` ended it, and the round
waited for it all that while. Plain and secure rounds share the path; both are tried.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any

import numpy as np
import pytest
from grpc._cython import cygrpc
from lifecycle_support import ClientThreads, GatedClient, wait_until

from fedloom import Weights
from fedloom.client_sdk import connection as connection_module
from fedloom.client_sdk import runner as runner_module
from fedloom.errors import TransportError
from fedloom.messages import PROTOCOL_VERSION, Capability, JoinRequest
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.secagg import SecAggConfig
from fedloom.server import Server
from fedloom.server.coordinator import Coordinator
from fedloom.server.persistence import RunPersistence
from fedloom.server.plain_round import FitPhase, issue_phase
from fedloom.server.rounds import RoundTasks
from fedloom.server.servicer import FleetServicer
from fedloom.strategies import build_strategy
from fedloom.types import TaskKind


class _DiesMidDownload(connection_module.Connection):
    """The "victim" client's connection: it reads a large task's header, then closes its
    channel as a killed process would, leaving the server blocked in its write."""

    stalled = threading.Event()
    session_ids: list[str] = []

    def _receive_task(self, stream: Any, watchdog: Any, whole_stream: bool) -> Any:
        if not self.config.name.startswith("victim") or self.stalled.is_set():
            return super()._receive_task(stream, watchdog, whole_stream)
        first = next(stream)
        if first.WhichOneof("part") != "task" or first.task.weights.total_bytes < 1 << 22:
            return super()._receive_task(itertools.chain([first], stream), watchdog,
                                         whole_stream)
        assert self.session is not None
        self.session_ids.append(self.session.client_id)
        next(stream)  # the first chunk: the server now blocks writing the rest
        self.stalled.set()
        self._channel.close()
        raise TransportError("the victim died mid-download")


def _large_weights() -> Weights:
    return Weights({"w": np.zeros(2_000_000, np.float32)})  # 8 MB: the writes block


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secure"])
def test_a_client_cut_mid_download_is_dropped_at_once(
        server_config, monkeypatch: pytest.MonkeyPatch, secure: bool) -> None:  # type: ignore[no-untyped-def]
    # Over a real connection, whether gRPC fails the server's pending write or cancels
    # its call first is a race; either way the session must end at once. The test
    # after this one makes the failed write certain.
    _DiesMidDownload.stalled = threading.Event()
    _DiesMidDownload.session_ids = []
    monkeypatch.setattr(runner_module, "Connection", _DiesMidDownload)
    overrides: dict[str, Any] = dict(num_rounds=1, min_clients=4, min_fit_clients=3,
                                     fraction_evaluate=0.0, client_timeout_s=60.0)
    if secure:
        overrides["secure_aggregation"] = SecAggConfig(
            enabled=True, neighbours=2, threshold=2, max_weight=100.0, max_participants=64,
            bits=24, allow_unauthenticated=True)
    handle = Server(server_config(**overrides), initial_weights=_large_weights()).start()
    coordinator = handle.server.coordinator
    assert coordinator is not None
    clients = [GatedClient() for _ in range(4)]
    pool = ClientThreads(handle.address, clients[:3])  # type: ignore[arg-type]
    victim = ClientThreads(handle.address, clients[3:], prefix="victim-")  # type: ignore[arg-type]
    try:
        wait_until(_DiesMidDownload.stalled.is_set, 20.0, "the victim to stall mid-download")
        dead = _DiesMidDownload.session_ids[0]
        wait_until(lambda: dead not in coordinator.registry, 5.0,
                   "the dead session to be dropped (not after client_timeout_s = 60 s)")
        history = handle.wait(30)
        assert [r.status for r in history] == ["ok"]
    finally:
        victim.close()
        pool.close()


class _DeadClientContext:
    """A servicer context whose client died mid-download: the write of the model's
    first chunk fails as gRPC's core reports it (not as a cancel)."""

    def __init__(self) -> None:
        self.writes = 0

    async def write(self, message: object) -> None:
        self.writes += 1
        if self.writes > 1:
            raise cygrpc.ExecuteBatchError('Failed "execute_batch": (SendMessageOperation,)')

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"

    async def abort(self, code: object, details: str) -> None:
        raise AssertionError(f"the stream was refused ({code}: {details}), not dropped")


@pytest.mark.parametrize("rpc", ["Tasks", "Pull"])
def test_a_failed_write_ends_the_session_and_its_task(server_config, rpc: str) -> None:  # type: ignore[no-untyped-def]
    """Deterministic: the failed write itself, on both task RPCs (plain and secure rounds
    send their tasks through these two handlers)."""
    config = server_config(client_timeout_s=60.0)

    async def scenario() -> None:
        strategy = build_strategy(config.strategy, config.selection)
        persistence = RunPersistence.open(config, _large_weights(), strategy)
        coordinator = Coordinator(config, strategy, persistence)
        try:
            join = JoinRequest(PROTOCOL_VERSION, frozenset(Capability), "site-0", "")
            reply = coordinator.join(join)
            parts = coordinator.rounds.parts
            phase = RoundTasks(1, TaskKind.FIT, minimum=1)
            issue_phase(parts, phase, FitPhase(parts, phase), (reply.session.client_id,),
                        {}, 30.0)
            request = pb.PullRequest(session=codec.session_to_proto(reply.session))
            context = _DeadClientContext()
            await getattr(FleetServicer(coordinator), rpc)(request, context)
            assert context.writes == 2  # the header went out, the first chunk failed
            assert reply.session.client_id not in coordinator.registry
            assert phase.num_answered == 1 and phase.failures  # the task failed at once
        finally:
            persistence.close()

    asyncio.run(scenario())
