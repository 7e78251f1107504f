"""fedloom over loopback gRPC for benchmarks/secagg.py: a pool of spawned client processes.

The server runs in the benchmark's process (`fedloom.server.Server`); the clients run
in a pool of worker processes started once with ``spawn`` and reused for every setting
(starting 50 Python processes per setting would cost more than the rounds). A setting
with more clients than workers puts several clients (threads, each a full
`ClientRunner` with its own channel) in one process. Every client connects over mutual
TLS with its own certificate (``bench-<index>`` of the benchmark's throwaway PKI), so
secure rounds are authenticated: signed keys, checked certificates, the consistency
stage.

Each client is a `BenchRunner`: an ordinary `ClientRunner` with a middleware and an
``on_pushed`` listener (the SDK's public seams) that

- counts the protobuf bytes of every request it sends and every response it receives
  (a gRPC client interceptor on its channel: what goes on the wire, less HTTP/2 framing
  and TLS records), and the bytes it sends per SecAgg+ stage;
- times its CPU per step: ``train`` (the client's fit), ``update`` (delta and
  serialisation of a plain update), each SecAgg+ stage (`ClientRunner.secagg_cpu_s`)
  and ``push`` (sending the result);
- drops out when told: in a plain round a fifth of the clients (by index and round)
  train and then report a failure instead of their update; in a secure round the
  clients `spread_dropouts` picks on the attempt's neighbour graph (which every client
  derives at share keys; the middleware derives it alike) answer advertise keys and
  share keys, then report a failure to their masked-input task (they drop after sharing
  their keys: the server removes their masks with their neighbours' shares).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from multiprocessing.connection import Connection
from typing import Any

import grpc
import numpy as np

from fedloom.client_sdk import (
    CallNext,
    Client,
    ClientRunner,
    EvaluateOutput,
    FitOutput,
    TaskContext,
    TaskResult,
)
from fedloom.config import ClientConfig
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.secagg import (
    AdvertiseKeysRequest,
    MaskedInputRequest,
    RoundSetup,
    SecAggRequest,
    ShareKeysRequest,
    graph_seed,
    neighbour_graph,
)
from fedloom.simulations.secure_dropout import spread_dropouts
from fedloom.types import TaskKind
from fedloom.weights import Weights

NUM_EXAMPLES = 100
STEP = 0.01
_local = threading.local()


class Traffic:
    """Bytes one client sent and received."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0


def _varint_bytes(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _size(message: Any) -> int:
    """Serialized bytes of a protobuf message, or of a frame already serialized.

    A weights chunk's size is computed from its fields: `ByteSize()` serializes the
    message to measure it (milliseconds per 1 MiB chunk), which would add client CPU to
    both modes and hide part of the secure round's extra cost.
    """
    if isinstance(message, bytes | bytearray | memoryview):
        return len(message)
    if isinstance(message, pb.PullResponse) and message.WhichOneof("part") == "chunk":
        chunk = message.chunk
        n = len(chunk.data)
        inner = 1 + _varint_bytes(n) + n  # field 2: data
        if chunk.offset:
            inner += 1 + _varint_bytes(chunk.offset)  # field 1: offset
        return 1 + _varint_bytes(inner) + inner  # PullResponse field 2: chunk
    return int(message.ByteSize())


class _CountingStream:
    """A response stream that counts what it yields (and passes everything else on)."""

    def __init__(self, call: Any, traffic: Traffic) -> None:
        self._call, self._traffic = call, traffic

    def __iter__(self) -> _CountingStream:
        return self

    def __next__(self) -> Any:
        message = next(self._call)
        self._traffic.received += _size(message)
        return message

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


class _Counter(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
               grpc.StreamUnaryClientInterceptor):
    def __init__(self, traffic: Traffic) -> None:
        self.traffic = traffic

    def _requests(self, requests: Iterator[Any]) -> Iterator[Any]:
        for request in requests:  # a message, or a frame the codec built (bytes)
            self.traffic.sent += _size(request)
            yield request

    def _answered(self, outcome: Any) -> Any:
        with contextlib.suppress(Exception):  # the caller sees the error itself
            self.traffic.received += _size(outcome.result())
        return outcome

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self.traffic.sent += _size(request)
        return self._answered(continuation(details, request))

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        self.traffic.sent += _size(request)
        return _CountingStream(continuation(details, request), self.traffic)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return self._answered(continuation(details, self._requests(requests)))


def install_counter() -> None:
    """Make every channel count its traffic into the creating thread's `Traffic` (a
    `BenchRunner` creates its channels in its own thread)."""
    plain, secure = grpc.insecure_channel, grpc.secure_channel

    def counted(channel: Any) -> Any:
        traffic = getattr(_local, "traffic", None)
        return channel if traffic is None else grpc.intercept_channel(channel, _Counter(traffic))

    def counting_plain(target: str, options: Any = None, compression: Any = None) -> Any:
        return counted(plain(target, options=options, compression=compression))

    def counting_secure(target: str, credentials: Any, options: Any = None,
                        compression: Any = None) -> Any:
        return counted(secure(target, credentials, options=options, compression=compression))

    grpc.insecure_channel, grpc.secure_channel = counting_plain, counting_secure


def fixed_step(index: int, size: int) -> np.ndarray:
    """Client ``index``'s "training": a fixed step, uniform in +-STEP (float32)."""
    rng = np.random.default_rng(index)
    return (rng.random(size, dtype=np.float32) - np.float32(0.5)) * np.float32(2 * STEP)


class BenchClient(Client):
    """Adds a fixed random step (seeded by its index) to the weights; times its fit."""

    def __init__(self, index: int, cpu: dict[str, float]) -> None:
        self.index, self.cpu = index, cpu
        self.steps: dict[int, np.ndarray] = {}

    def fit(self, weights: Weights, config: Any) -> FitOutput:
        (name, arr), = weights.items()
        step = self.steps.get(arr.size)
        if step is None:  # made once per size, not counted as training
            step = self.steps[arr.size] = fixed_step(self.index, arr.size)
        started = time.thread_time()
        out = FitOutput(Weights({name: arr + step}), NUM_EXAMPLES)
        self.cpu["train"] += time.thread_time() - started
        return out

    def evaluate(self, weights: Weights, config: Any) -> EvaluateOutput:
        return EvaluateOutput(0.0, NUM_EXAMPLES)


class BenchRunner(ClientRunner):
    """A `ClientRunner` that counts bytes, times its steps and drops out on cue, through
    the SDK's public seams: a middleware and ``on_pushed``."""

    def __init__(self, index: int, address: str, dropout: float, pki: str,
                 task_stream: bool = True) -> None:
        self.cpu: dict[str, float] = defaultdict(float)
        name = f"bench-{index}"
        config = ClientConfig(server_address=address, name=name, root_ca=f"{pki}/ca.pem",
                              cert=f"{pki}/{name}.pem", key=f"{pki}/{name}.key",
                              rpc_timeout_s=120.0, task_stream=task_stream)
        super().__init__(BenchClient(index, self.cpu), config, middleware=[self._measure],
                         on_pushed=self._pushed)
        self.index, self.dropout = index, dropout
        self.traffic = Traffic()
        self.stage_sent: dict[str, int] = defaultdict(int)  # bytes pushed per SecAgg+ stage
        self.dropped = 0
        self._setup: RoundSetup | None = None  # of the latest advertise-keys request
        self._graph: tuple[RoundSetup, Mapping[str, frozenset[str]]] | None = None
        self._push_from = (0.0, 0)  # (thread CPU, bytes sent) when the result was ready

    def run(self) -> Any:
        _local.traffic = self.traffic
        return super().run()

    def _measure(self, context: TaskContext, call_next: CallNext) -> TaskResult:
        result = self._answer_or_drop(context, call_next)
        self._push_from = (time.thread_time(), self.traffic.sent)
        return result

    def _answer_or_drop(self, context: TaskContext, call_next: CallNext) -> TaskResult:
        task, request = context.task, context.task.secagg
        if self.dropout:
            self._follow(request)
        if isinstance(request, MaskedInputRequest) and self._graph is not None:
            setup, graph = self._graph
            count = round(self.dropout * len(setup.participants))
            if (setup.round_id == request.round_id and context.session.client_id
                    in spread_dropouts(graph, setup.threshold, graph, count)):
                return self._failure(context)
        if task.kind is not TaskKind.FIT:
            return call_next(context)
        if self.dropout and (self.index + task.round) % round(1 / self.dropout) == 0:
            self.client.fit(context.weights, task.config)  # it trains, then vanishes
            return self._failure(context)
        started, trained = time.thread_time(), self.cpu["train"]
        result = call_next(context)
        self.cpu["update"] += time.thread_time() - started - (self.cpu["train"] - trained)
        return result

    def _follow(self, request: SecAggRequest | None) -> None:
        """Derive each attempt's neighbour graph at share keys, from the setup and every
        participant's keys, as each client does (`fedloom.secagg.neighbour_graph`)."""
        if isinstance(request, AdvertiseKeysRequest):
            self._setup = request.setup
        elif isinstance(request, ShareKeysRequest):
            setup = request.setup or self._setup
            if setup is not None and setup.round_id == request.round_id:
                members = [keys.client_id for keys in request.roster]
                seed = graph_seed(setup, request.roster)
                self._graph = setup, neighbour_graph(members, setup.neighbours, seed)

    def _failure(self, context: TaskContext) -> TaskResult:
        self.dropped += 1
        return context.failure("benchmark dropout")

    def _pushed(self, context: TaskContext, result: TaskResult, *, refused: bool) -> None:
        started, sent = self._push_from
        self.cpu["push"] += time.thread_time() - started
        stage = context.stage
        if stage is not None:
            self.stage_sent[str(stage)] += self.traffic.sent - sent


def _serve_command(command: dict[str, Any]) -> list[dict[str, Any]]:
    runners = [BenchRunner(i, command["address"], command["dropout"], command["pki"],
                           command["task_stream"])
               for i in command["indices"]]
    threads = [threading.Thread(target=r.run, daemon=True) for r in runners]
    started = time.process_time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(command["timeout_s"])
    process_cpu = time.process_time() - started
    return [{"index": r.index, "sent": r.traffic.sent, "received": r.traffic.received,
             "stage_sent": dict(r.stage_sent),
             "cpu_s": {**r.cpu, **r.secagg_cpu_s}, "dropped": r.dropped,
             "finished": r.stats.run_finished,
             "process_cpu_s": process_cpu / len(runners)} for r in runners]


def worker_main(conn: Connection) -> None:
    """A pool worker: run the clients each command names, report, wait for the next."""
    import logging

    logging.basicConfig(level=logging.ERROR)
    install_counter()
    while True:
        command = conn.recv()
        if command is None:
            return
        conn.send(_serve_command(command))


class ClientPool:
    """``size`` spawned worker processes that run benchmark clients on command."""

    def __init__(self, size: int) -> None:
        context = multiprocessing.get_context("spawn")
        # Each worker stands for a one-core device: one BLAS thread (the distributed-DP
        # encoding's transform is a matrix product; 20 two-thread OpenBLAS pools on two
        # cores spin against each other). Spawned workers read it as numpy loads.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        self.pipes: list[Connection] = []
        self.processes = []
        for _ in range(size):
            parent, child = context.Pipe()
            process = context.Process(target=worker_main, args=(child,), daemon=True)
            process.start()
            self.pipes.append(parent)
            self.processes.append(process)

    def run(self, address: str, clients: int, dropout: float, timeout_s: float, pki: str,
            task_stream: bool = True) -> list[tuple[int, Connection]]:
        """Start ``clients`` clients spread over the workers; returns what to collect.
        ``pki``: the folder of ``ca.pem`` and each client's ``bench-<i>.pem``/``.key``."""
        used = min(clients, len(self.pipes))
        pending = []
        for w in range(used):
            indices = list(range(w, clients, used))
            self.pipes[w].send({"address": address, "indices": indices, "dropout": dropout,
                                "timeout_s": timeout_s, "task_stream": task_stream,
                                "pki": pki})
            pending.append((w, self.pipes[w]))
        return pending

    @staticmethod
    def collect(pending: list[tuple[int, Connection]], timeout_s: float) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for w, pipe in pending:
            if not pipe.poll(timeout_s):
                raise TimeoutError(f"client worker {w} did not report")
            for row in pipe.recv():
                out.append({**row, "worker": w})
        return out

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for process in self.processes:
            process.join(10)
