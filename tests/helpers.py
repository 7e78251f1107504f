"""Test helpers: scripted clients and client threads on loopback."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from fedloom import Weights
from fedloom.client_sdk import Client, EvaluateOutput, FitOutput, start_client
from fedloom.client_sdk.connection import Connection
from fedloom.config import ClientConfig, TransferConfig
from fedloom.messages import Session, TaskHeader
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc


class ScriptedClient(Client):
    """Adds a seeded random step to every tensor; records what it sent."""

    def __init__(self, seed: int, num_examples: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.num_examples = num_examples
        self.sent: list[tuple[int, Weights, Weights]] = []  # (round, global, new)

    def fit(self, weights: Weights, config):  # type: ignore[no-untyped-def]
        new = Weights(
            {n: (a + self.rng.normal(size=a.shape)).astype(a.dtype) for n, a in weights.items()}
        )
        self.sent.append((int(config["server_round"]), weights.copy(), new))
        return FitOutput(new, self.num_examples, {"train_loss": 1.0})

    def evaluate(self, weights: Weights, config):  # type: ignore[no-untyped-def]
        return EvaluateOutput(float(np.mean(weights["w"])), self.num_examples, {"accuracy": 0.5})


def small_weights() -> Weights:
    return Weights({"w": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.float32)})


def random_weights(shapes: dict[str, tuple[tuple[int, ...], type]],
                   rng: np.random.Generator) -> Weights:
    """Weights of the given ``{name: (shape, dtype)}``: integers in [-50, 50) for integer
    dtypes, standard normal values for float ones."""
    out = {}
    for name, (shape, dtype) in shapes.items():
        if np.dtype(dtype).kind in "iu":
            out[name] = rng.integers(-50, 50, size=shape).astype(dtype)
        else:
            out[name] = rng.normal(size=shape).astype(dtype)
    return Weights(out)


def pull_task(stub: pb_grpc.FleetStub, session: Session, within_s: float = 20.0) -> TaskHeader:
    """The next task for ``session``, long-polled with raw Pulls (bounded)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        stream = stub.Pull(pb.PullRequest(session=codec.session_to_proto(session)),
                           timeout=within_s)
        messages = list(stream)
        if messages[0].WhichOneof("part") == "task":
            return codec.task_from_proto(messages[0].task)
    raise AssertionError("no task came")


def run_clients(address: str, clients: list[Client], **kwargs) -> list[threading.Thread]:  # type: ignore[no-untyped-def]
    config = ClientConfig(
        server_address=address,
        rpc_timeout_s=10.0,
        reconnect_initial_s=0.05,
        reconnect_max_s=0.5,
        insecure=True,
    )
    threads = []
    for i, client in enumerate(clients):
        t = threading.Thread(
            target=start_client,
            args=(address, client),
            daemon=True,
            kwargs={"name": f"c{i}", "config": config, "handle_signals": False, **kwargs},
        )
        t.start()
        threads.append(t)
    return threads


def run_to_end(handle: Any, clients: list[Client]) -> list[Any]:
    """Run ``clients`` (threads, plaintext) against a started server until its run ends;
    the run's history (`fedloom.server.ServerHandle.wait`)."""
    threads = run_clients(handle.address, clients)
    history = handle.wait(60)
    for thread in threads:
        thread.join(10)
    return history  # type: ignore[no-any-return]


def scripted(n: int) -> list[Client]:
    """``n`` `ScriptedClient`s, seeds 0..n-1, 5 examples each."""
    return [ScriptedClient(seed=i, num_examples=5) for i in range(n)]


class RecordsLeaves:
    """What most fake servers share (mix in before ``FleetServicer``): heartbeats are
    answered, and each Leave's reason is recorded in ``left``."""

    def __init__(self) -> None:
        self.left: list[str] = []
        self.lock = threading.Lock()

    def Heartbeat(self, request: Any, context: Any) -> pb.HeartbeatResponse:
        return pb.HeartbeatResponse()

    def Leave(self, request: Any, context: Any) -> pb.LeaveResponse:
        with self.lock:
            self.left.append(request.reason)
        return pb.LeaveResponse()


@contextlib.contextmanager
def fake_fleet(servicer: pb_grpc.FleetServicer) -> Iterator[str]:
    """Serve a hand-written Fleet servicer (a fake server) on loopback; yields its address."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_FleetServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def fake_fleet_connection(address: str, rpc_timeout_s: float, task_stream: bool = True
                          ) -> Connection:
    """A plaintext `Connection` to a `fake_fleet`, with small transfer limits (1 KiB chunks,
    models up to 4 KiB), not yet joined; tasks come from the Tasks stream unless
    ``task_stream`` is False (one Pull per task)."""
    transfer = TransferConfig(chunk_size=1024, max_message_bytes=64 * 1024, max_model_bytes=4096)
    return Connection(ClientConfig(server_address=address, rpc_timeout_s=rpc_timeout_s,
                                   transfer=transfer, insecure=True, task_stream=task_stream))


def committed_models(state_dir: str | Path) -> dict[int, Weights]:
    """Every committed round's model of the newest run in ``state_dir``, by round (0:
    the initial one), read from its verified checkpoint."""
    from fedloom.server.checkpoint import load_checkpoint
    from fedloom.server.store import RunStore

    store = RunStore(Path(state_dir) / "fedloom.db", readonly=True)
    try:
        rows = store.rounds(store.runs()[-1].run_id)
    finally:
        store.close()
    return {row.round: load_checkpoint(Path(state_dir) / row.checkpoint, row.sha256).weights
            for row in rows}
