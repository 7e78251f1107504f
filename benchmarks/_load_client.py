"""A lean asyncio client of the Fleet protocol, for driving hundreds from one process.

The SDK's `Connection` is synchronous (a thread per client, a watchdog thread per
Pull): right for an application, too heavy for 500 clients on two cores. This client
speaks the same protocol through the generated stubs and `fedloom.protos.codec`, and
checks what it downloads the way the SDK does (`PayloadReceiver`: order, sizes,
finite values, SHA-256). Each client has its own channel and TCP connection
(``grpc.use_local_subchannel_pool``), as separate devices would.

What each client does: join (at a random moment within ``ramp_s``), heartbeat every
interval the server asked for, long-poll Pull; on a fit task, "train" for a random
time in ``[0, train_s]`` and push a small random delta; on an evaluate task, push a
loss; leave when the server says the run is over. Every RPC's latency and every error
is recorded in `LoadStats`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import Any

import grpc
import numpy as np

from fedloom.errors import MessageRejectedError
from fedloom.messages import PROTOCOL_VERSION, JoinRequest, ResultHeader, Session, TaskHeader
from fedloom.payload import PayloadInfo, PayloadReceiver, deserialize, iter_chunks, serialize
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc
from fedloom.types import TaskKind
from fedloom.weights import Weights

CHANNEL_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),  # one TCP connection per client
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 4 << 20),
    ("grpc.max_send_message_length", 4 << 20),
]


@dataclasses.dataclass
class LoadStats:
    """What a set of clients saw; plain lists, so it pickles across processes."""

    join_s: list[float] = dataclasses.field(default_factory=list)
    heartbeat_s: list[float] = dataclasses.field(default_factory=list)
    push_fit_s: list[float] = dataclasses.field(default_factory=list)
    push_evaluate_s: list[float] = dataclasses.field(default_factory=list)
    download_s: list[float] = dataclasses.field(default_factory=list)  # task header -> verified
    fit_received: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # round, t
    fits: int = 0
    evaluations: int = 0
    refused: list[str] = dataclasses.field(default_factory=list)  # late or refused results
    errors: list[str] = dataclasses.field(default_factory=list)
    finished: int = 0  # clients that heard "run finished" and left

    def merge(self, other: LoadStats) -> None:
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            setattr(self, field.name, mine + theirs)


class _Sink:
    def __init__(self, size: int) -> None:
        self.buffer = bytearray(size)
        self._pos = 0

    def write(self, data: bytes) -> None:
        self.buffer[self._pos : self._pos + len(data)] = data
        self._pos += len(data)


class LoadClient:
    """One simulated device (see the module docstring)."""

    def __init__(
        self,
        index: int,
        address: str,
        stats: LoadStats,
        *,
        seed: int,
        ramp_s: float = 2.0,
        train_s: float = 0.2,
        rpc_timeout_s: float = 60.0,
    ) -> None:
        self.name = f"load-{index:04d}"
        self.address = address
        self.stats = stats
        self.rng = random.Random(seed * 100_003 + index)
        self.ramp_s, self.train_s, self.rpc_timeout_s = ramp_s, train_s, rpc_timeout_s
        self.session: Session | None = None
        self._long_poll_s = 20.0

    async def run(self) -> None:
        await asyncio.sleep(self.rng.uniform(0.0, self.ramp_s))
        async with grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.FleetStub(channel)
            while True:  # join (again, after the server forgot us)
                if not await self._join(stub):
                    await asyncio.sleep(1.0)
                    continue
                beats = asyncio.create_task(self._heartbeats(stub))
                try:
                    outcome = await self._serve(stub)
                finally:
                    beats.cancel()
                if outcome == "finished":
                    await self._leave(stub)
                    self.stats.finished += 1
                    return

    # -- session --------------------------------------------------------------------
    async def _join(self, stub: Any) -> bool:
        request = JoinRequest(PROTOCOL_VERSION, frozenset({"fit", "evaluate"}), self.name)
        started = time.perf_counter()
        try:
            reply = await stub.Join(
                codec.join_request_to_proto(request), timeout=self.rpc_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            self._error("join", exc)
            return False
        self.stats.join_s.append(time.perf_counter() - started)
        grant = codec.join_reply_from_proto(reply)
        self.session = grant.session
        self._long_poll_s = grant.long_poll_s
        self._heartbeat_s = grant.heartbeat_interval_s
        self._chunk_size = grant.chunk_size  # a payload of several chunks: all full-size
        return True

    async def _heartbeats(self, stub: Any) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            started = time.perf_counter()
            try:
                await stub.Heartbeat(
                    pb.HeartbeatRequest(session=self._session()), timeout=self.rpc_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                self._error("heartbeat", exc)
                continue
            self.stats.heartbeat_s.append(time.perf_counter() - started)

    async def _leave(self, stub: Any) -> None:
        try:
            await stub.Leave(pb.LeaveRequest(session=self._session(), reason="done"), timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            self._error("leave", exc)

    def _session(self) -> pb.Session:
        assert self.session is not None
        return codec.session_to_proto(self.session)

    def _error(self, rpc: str, exc: grpc.aio.AioRpcError) -> None:
        self.stats.errors.append(f"{rpc}: {exc.code().name}: {exc.details()}")

    # -- tasks ----------------------------------------------------------------------
    async def _serve(self, stub: Any) -> str:
        """Pull and answer tasks; "finished" at the end of the run, "rejoin" if forgotten."""
        while True:
            try:
                pulled = await self._pull(stub)
            except grpc.aio.AioRpcError as exc:
                self._error("pull", exc)
                if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
                    return "rejoin"
                await asyncio.sleep(1.0)
                continue
            if pulled == "finished":
                return "finished"
            if not isinstance(pulled, tuple):
                continue
            task, weights = pulled
            await self._answer(stub, task, weights)

    async def _pull(self, stub: Any) -> tuple[TaskHeader, Weights] | str | None:
        call = stub.Pull(
            pb.PullRequest(session=self._session()),
            timeout=self._long_poll_s + self.rpc_timeout_s,
        )
        first = await call.read()
        if first is grpc.aio.EOF:
            self.stats.errors.append("pull: stream closed without an answer")
            return None
        if first.WhichOneof("part") == "no_task":
            return "finished" if first.no_task.run_finished else None
        header_at = time.perf_counter()
        try:
            task = codec.task_from_proto(first.task)
            info = task.weights
            sink = _Sink(info.total_bytes)
            receiver = PayloadReceiver(
                info.specs, info.total_bytes, info.sha256, sink, max_chunk_bytes=4 << 20
            )
            while (message := await call.read()) is not grpc.aio.EOF:
                receiver.feed(*codec.chunk_from_proto(message.chunk))
            receiver.finish()
        except MessageRejectedError as exc:
            self.stats.errors.append(f"pull: the task failed verification: {exc}")
            return None
        if task.kind is TaskKind.FIT:
            self.stats.fit_received.append((task.round, time.time()))
        self.stats.download_s.append(time.perf_counter() - header_at)
        return task, deserialize(info.specs, memoryview(sink.buffer).toreadonly())

    async def _answer(self, stub: Any, task: TaskHeader, weights: Weights) -> None:
        assert self.session is not None
        if task.kind is TaskKind.FIT:
            await asyncio.sleep(self.rng.uniform(0.0, self.train_s))
            gen = np.random.default_rng(self.rng.getrandbits(63))
            delta = Weights(
                {
                    n: (gen.standard_normal(a.shape) * 0.01).astype(a.dtype)
                    for n, a in weights.items()
                }
            )
            payload = serialize(delta)
            header = ResultHeader(
                self.session,
                task.task_id,
                task.round,
                TaskKind.FIT,
                num_examples=self.rng.randint(10, 100),
                base_round=task.round - 1,
                metrics={"train_loss": self.rng.random()},
                update=PayloadInfo.describe(delta.specs(), payload),
            )
            latencies, self.stats.fits = self.stats.push_fit_s, self.stats.fits + 1
        elif task.kind is TaskKind.EVALUATE:
            payload = None
            header = ResultHeader(
                self.session,
                task.task_id,
                task.round,
                TaskKind.EVALUATE,
                num_examples=self.rng.randint(10, 100),
                loss=self.rng.random(),
                metrics={"accuracy": self.rng.random()},
            )
            latencies, self.stats.evaluations = (
                self.stats.push_evaluate_s,
                self.stats.evaluations + 1,
            )
        else:
            self.stats.errors.append(f"pull: unexpected task kind {task.kind}")
            return

        def messages() -> Any:
            yield codec.result_to_proto(header)
            if payload is not None:
                yield from codec.chunks_for_push(iter_chunks(payload, self._chunk_size))

        started = time.perf_counter()
        try:
            await stub.Push(messages(), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
                self.stats.refused.append(exc.details() or "")  # e.g. "round N closed"
            else:
                self._error("push", exc)
            return
        latencies.append(time.perf_counter() - started)


async def drive(
    address: str,
    indices: range,
    *,
    seed: int = 0,
    ramp_s: float = 2.0,
    train_s: float = 0.2,
) -> LoadStats:
    """Run clients ``indices`` against ``address`` until the run ends; their stats."""
    stats = LoadStats()
    clients = [
        LoadClient(i, address, stats, seed=seed, ramp_s=ramp_s, train_s=train_s) for i in indices
    ]
    results = await asyncio.gather(*(c.run() for c in clients), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            stats.errors.append(f"client crashed: {type(result).__name__}: {result}")
    return stats
