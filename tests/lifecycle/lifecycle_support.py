"""Helpers of the lifecycle tests: clients that hold a round open, bounded polling, the
``fedloom server`` and ``fedloom client`` commands as child processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

from fedloom import Weights
from fedloom.client_sdk import Client, ClientStats, EvaluateOutput, FitOutput, start_client
from fedloom.config import ClientConfig
from fedloom.messages import PROTOCOL_VERSION, Capability, JoinRequest, ResultHeader
from fedloom.payload import PayloadInfo, serialize
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc
from fedloom.server import save_weights
from fedloom.types import TaskKind


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0,
               what: str = "condition") -> None:
    """Poll ``condition`` every 10 ms until it holds; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


def tiny_weights() -> Weights:
    return Weights({"w": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.float32)})


class GatedClient(Client):
    """Trains only once ``gate`` is set (a round stays open until then); adds 1 / 64."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.started = threading.Event()  # set when a fit begins
        self.fits = 0

    def fit(self, weights, config):  # type: ignore[no-untyped-def]
        self.started.set()
        if self.gate is not None:
            self.gate.wait(30.0)
        self.fits += 1
        new = Weights({n: a + np.asarray(1 / 64, a.dtype) for n, a in weights.items()})
        return FitOutput(new, 1, {})

    def evaluate(self, weights, config):  # type: ignore[no-untyped-def]
        return EvaluateOutput(0.0, 1, {})


class ClientThreads:
    """`start_client` loops in threads, stopped by one event; their stats and errors."""

    def __init__(self, address: str, clients: list[Client], prefix: str = "site-",
                 **config: object) -> None:
        self.prefix = prefix  # client i joins as f"{prefix}{i}"
        self.stop = threading.Event()
        self.stats: dict[int, ClientStats] = {}
        self.errors: list[BaseException] = []
        settings: dict = dict(server_address=address, rpc_timeout_s=5.0,
                              reconnect_initial_s=0.05, reconnect_max_s=0.3, insecure=True)
        settings.update(config)
        self.config = ClientConfig(**settings)
        self.threads = [threading.Thread(target=self._run, args=(i, c), daemon=True)
                        for i, c in enumerate(clients)]
        for thread in self.threads:
            thread.start()

    def _run(self, index: int, client: Client) -> None:
        try:
            self.stats[index] = start_client(self.config.server_address, client,
                                             name=f"{self.prefix}{index}", config=self.config,
                                             stop=self.stop, handle_signals=False)
        except BaseException as exc:  # reported by close()
            self.errors.append(exc)

    def close(self, timeout_s: float = 10.0) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    return repr(value)


class ServerCommand:
    """``fedloom server --config FILE --initial-weights FILE`` as a child process, its
    output in a log file (the tests read the "listening" line and the exit status)."""

    def __init__(self, folder: Path, **settings: object) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.state_dir = folder / "state"
        base: dict[str, object] = dict(
            address=self.address, num_rounds=2, min_clients=2, min_fit_clients=2,
            fraction_evaluate=0.0, state_dir=str(self.state_dir), progress=False,
            long_poll_s=1.0, heartbeat_interval_s=0.5, client_timeout_s=10.0,
            insecure=True)
        base.update(settings)
        self.config = folder / "server.toml"
        self.config.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in base.items()))
        self.weights = folder / "initial.safetensors"
        save_weights(self.weights, tiny_weights())
        self.log = folder / "server.log"
        self.starts = 0

    def start(self, *flags: str, crash_at: str = "") -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if k != "FEDLOOM_CRASH_AT"}
        if crash_at:
            env["FEDLOOM_CRASH_AT"] = crash_at
        self.starts += 1
        command = [sys.executable, "-m", "fedloom.cli", "server", "--config", str(self.config),
                   "--initial-weights", str(self.weights), *flags]
        with open(self.log, "ab") as out:
            out.write(f"\n==== start {self.starts}\n".encode())
            out.flush()
            return subprocess.Popen(command, env=env, stdout=out, stderr=out)

    def output(self) -> str:
        """What this start has logged so far."""
        text = self.log.read_text(errors="replace")
        return text[text.rfind(f"==== start {self.starts}\n"):]

    def wait_serving(self, process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
        wait_until(lambda: "server listening on" in self.output() or process.poll() is not None,
                   timeout_s, "the server to listen")
        assert process.poll() is None, f"the server exited:\n{self.output()}"

    def wait(self, process: subprocess.Popen[bytes], timeout_s: float) -> int:
        try:
            return process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
            raise AssertionError(f"the server ran past {timeout_s} s:\n{self.output()}") from None


def client_command(address: str, name: str, log: Path) -> subprocess.Popen[bytes]:
    """``fedloom client`` running a `GatedClient` (from this module) as ``name``."""
    command = [sys.executable, "-m", "fedloom.cli", "client", "--server", address,
               "--app", "lifecycle_support:GatedClient", "--name", name, "--insecure"]
    with open(log, "ab") as out:
        return subprocess.Popen(command, cwd=Path(__file__).parent, stdout=out, stderr=out)


class RawSession:
    """A session joined by hand over its own channel, to send what the SDK never would."""

    def __init__(self, address: str, name: str, token: str = "",
                 options: tuple[tuple[str, object], ...] = ()) -> None:
        self.channel = grpc.insecure_channel(
            address, options=[("grpc.use_local_subchannel_pool", 1), *options])
        self.stub = pb_grpc.FleetStub(self.channel)
        request = JoinRequest(PROTOCOL_VERSION, frozenset(Capability), name, token)
        reply = self.stub.Join(codec.join_request_to_proto(request), timeout=10)
        self.session = codec.join_reply_from_proto(reply).session

    def close(self) -> None:
        self.channel.close()

    def heartbeat(self) -> grpc.StatusCode:
        request = pb.HeartbeatRequest(session=codec.session_to_proto(self.session))
        return _status(lambda: self.stub.Heartbeat(request, timeout=10))

    def send_invalid(self) -> grpc.StatusCode:
        """A Report carrying a payload (which only Push may): INVALID, a strike."""
        update = PayloadInfo.describe(tiny_weights().specs(), bytes(serialize(tiny_weights())))
        header = ResultHeader(self.session, "0" * 32, 1, TaskKind.FIT, num_examples=1,
                              base_round=0, update=update)
        return _status(lambda: self.stub.Report(codec.result_to_proto(header), timeout=10))


def join_status(address: str, name: str, token: str = "") -> grpc.StatusCode:
    """The status a Join as ``name`` earns (its channel is closed at once)."""
    try:
        RawSession(address, name, token).close()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _status(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK
