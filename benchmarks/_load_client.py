"""A lean asyncio client of the Fleet protocol, for driving thousands from one process.

The SDK's `Connection` is synchronous (a thread per client, a watchdog thread per
stream): right for an application, too heavy for 1,000 clients sharing two cores with
the server they measure. This client speaks the same protocol the same way the SDK does
by default, through the generated stubs and `fedloom.protos.codec`: one Tasks stream per
session, a fit result through Push (header, then the update's chunk frames) or, when the
server granted the "inline" capability and the update is small, inside its header in one
Report call, an evaluation result in one Report call, a heartbeat every interval the
server asked for.
It checks what it downloads as the SDK does (`PayloadReceiver`: order, sizes, finite
values, SHA-256). Each client has its own channel and TCP connection
(``grpc.use_local_subchannel_pool``), as separate devices would.

What keeps it lean: a session's messages are built once (its `Session`, its heartbeat),
and its "training" sends one of a few updates made once per process (`UpdatePool`)
instead of drawing and hashing a new one per fit. The server cannot tell: it verifies
and folds each update as it would any other.

What each client does: join (at a random moment within ``ramp_s``), heartbeat, read its
Tasks stream; on a fit task, "train" for a random time in ``[0, train_s]`` and push an
update; on an evaluate task, report a loss; leave when the server says the run is over.
Every RPC's latency and every error is recorded in `LoadStats`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import resource
import time
from typing import Any

import grpc
import numpy as np

from fedloom.errors import MessageRejectedError
from fedloom.messages import PROTOCOL_VERSION, JoinRequest, ResultHeader, Session, TaskHeader
from fedloom.payload import (
    PayloadInfo,
    PayloadReceiver,
    inline_limit,
    iter_chunk_views,
    serialize,
)
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc
from fedloom.types import TaskKind
from fedloom.weights import TensorSpec, Weights

CHANNEL_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),  # one TCP connection per client
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 4 << 20),
    ("grpc.max_send_message_length", 4 << 20),
]

#: The stream's answer when the run is over.
FINISHED = "finished"


@dataclasses.dataclass
class LoadStats:
    """What a set of clients saw; plain lists, so it pickles across processes."""

    join_s: list[float] = dataclasses.field(default_factory=list)
    joined_at: list[float] = dataclasses.field(default_factory=list)  # wall clock, per join
    heartbeat_s: list[float] = dataclasses.field(default_factory=list)
    heartbeat_at: list[float] = dataclasses.field(default_factory=list)  # wall clock, each
    push_fit_s: list[float] = dataclasses.field(default_factory=list)
    push_evaluate_s: list[float] = dataclasses.field(default_factory=list)
    download_s: list[float] = dataclasses.field(default_factory=list)  # task header -> verified
    fit_received: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # round, t
    fits: int = 0
    evaluations: int = 0
    refused: list[str] = dataclasses.field(default_factory=list)  # late or refused results
    errors: list[str] = dataclasses.field(default_factory=list)
    finished: int = 0  # clients that heard "run finished" and left
    #: Leaves after "run finished" that the server no longer answered (it may stop once
    #: every session's stream has ended): best effort, as the SDK's, so not an error.
    unanswered_leaves: int = 0
    cpu_s: float = 0.0  # the client processes' CPU time

    def merge(self, other: LoadStats) -> None:
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            setattr(self, field.name, mine + theirs)


class UpdatePool:
    """A few random updates per model layout, serialized and described once."""

    def __init__(self, seed: int, size: int = 8) -> None:
        self._rng = np.random.default_rng(seed)
        self._size = size
        self._pools: dict[tuple[TensorSpec, ...], list[tuple[PayloadInfo, memoryview]]] = {}

    def pick(self, specs: tuple[TensorSpec, ...], rng: random.Random
             ) -> tuple[PayloadInfo, memoryview]:
        pool = self._pools.get(specs)
        if pool is None:
            pool = self._pools[specs] = [self._make(specs) for _ in range(self._size)]
        return pool[rng.randrange(len(pool))]

    def _make(self, specs: tuple[TensorSpec, ...]) -> tuple[PayloadInfo, memoryview]:
        delta = Weights({
            s.name: (self._rng.standard_normal(s.shape) * 0.01).astype(s.numpy_dtype)
            for s in specs
        })
        payload = serialize(delta)
        return PayloadInfo.describe(delta.specs(), payload), payload


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
        updates: UpdatePool,
        *,
        seed: int,
        ramp_s: float = 2.0,
        train_s: float = 0.2,
        rpc_timeout_s: float = 60.0,
    ) -> None:
        self.name = f"load-{index:05d}"
        self.address = address
        self.stats = stats
        self.updates = updates
        self.rng = random.Random(seed * 100_003 + index)
        self.ramp_s, self.train_s, self.rpc_timeout_s = ramp_s, train_s, rpc_timeout_s
        self.session: Session | None = None
        self.session_message = pb.Session()
        self._long_poll_s = 20.0
        self._heartbeat_s = 5.0
        self._chunk_size = 1 << 20
        self._inline = False  # the server granted "inline"

    async def run(self) -> None:
        await asyncio.sleep(self.rng.uniform(0.0, self.ramp_s))
        async with grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.FleetStub(channel)
            # Push with ready-made chunk frames (bytes) after the header, as the SDK sends.
            push = channel.stream_unary(
                "/fedloom.v1.Fleet/Push", request_serializer=codec.serialize_message,
                response_deserializer=pb.PushResponse.FromString)
            while True:  # join (again, after the server forgot us)
                if not await self.join(stub):
                    await asyncio.sleep(1.0)
                    continue
                beats = asyncio.create_task(self.heartbeats(stub))
                try:
                    outcome = await self._serve(stub, push)
                finally:
                    beats.cancel()
                if outcome == FINISHED:
                    await self.leave(stub)
                    self.stats.finished += 1
                    return

    # -- session --------------------------------------------------------------------
    async def join(self, stub: Any) -> bool:
        request = JoinRequest(PROTOCOL_VERSION, frozenset({"fit", "evaluate", "inline"}),
                              self.name)
        started = time.perf_counter()
        try:
            reply = await stub.Join(
                codec.join_request_to_proto(request), timeout=self.rpc_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            self._error("join", exc)
            return False
        self.stats.join_s.append(time.perf_counter() - started)
        self.stats.joined_at.append(time.time())
        grant = codec.join_reply_from_proto(reply)
        self.session = grant.session
        self.session_message = codec.session_to_proto(grant.session)
        self._long_poll_s = grant.long_poll_s
        self._heartbeat_s = grant.heartbeat_interval_s
        self._chunk_size = grant.chunk_size  # a payload of several chunks: all full-size
        self._inline = "inline" in grant.capabilities
        return True

    async def heartbeats(self, stub: Any) -> None:
        request = pb.HeartbeatRequest(session=self.session_message)
        while True:
            await asyncio.sleep(self._heartbeat_s)
            started = time.perf_counter()
            try:
                await stub.Heartbeat(request, timeout=self.rpc_timeout_s)
            except grpc.aio.AioRpcError as exc:
                self._error("heartbeat", exc)
                continue
            self.stats.heartbeat_s.append(time.perf_counter() - started)
            self.stats.heartbeat_at.append(time.time())

    async def leave(self, stub: Any) -> None:
        try:
            await stub.Leave(pb.LeaveRequest(session=self.session_message, reason="done"),
                             timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
                self.stats.unanswered_leaves += 1  # the finished server has stopped
            else:
                self._error("leave", exc)

    def _error(self, rpc: str, exc: grpc.aio.AioRpcError) -> None:
        self.stats.errors.append(f"{rpc}: {exc.code().name}: {exc.details()}")

    # -- tasks ----------------------------------------------------------------------
    async def _serve(self, stub: Any, push: Any) -> str:
        """Read and answer tasks from the session's Tasks stream (opened again if it
        breaks); `FINISHED` at the end of the run, "rejoin" if the server forgot us."""
        while True:
            call = stub.Tasks(pb.PullRequest(session=self.session_message))
            try:
                while True:
                    received = await self._next_task(call)
                    if received == FINISHED:
                        return FINISHED
                    if received is None:
                        break  # the stream ended without the run's end: open another
                    await self._answer(stub, push, *received)
            except grpc.aio.AioRpcError as exc:
                self._error("tasks", exc)
                if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
                    return "rejoin"
                await asyncio.sleep(1.0)
            except TimeoutError:
                self.stats.errors.append("tasks: the server sent nothing for a long-poll")
            finally:
                call.cancel()

    async def _read(self, call: Any) -> Any:
        async with asyncio.timeout(self._long_poll_s + self.rpc_timeout_s):
            return await call.read()

    async def _next_task(self, call: Any) -> tuple[TaskHeader, PayloadInfo] | str | None:
        """The next task on the stream, its payload verified; `FINISHED`; or None when
        the stream ended (or sent something this client cannot use)."""
        while True:
            first = await self._read(call)
            if first is grpc.aio.EOF:
                return None
            if first.WhichOneof("part") == "no_task":
                if first.no_task.run_finished:
                    return FINISHED
                continue  # the stream's keep-alive
            break
        header_at = time.perf_counter()
        try:
            task = codec.task_from_proto(first.task)
            info = task.weights
            receiver = PayloadReceiver(info.specs, info.total_bytes, info.sha256,
                                       _Sink(info.total_bytes), max_chunk_bytes=4 << 20)
            if first.task.inline_payload:  # the whole payload came with the header
                receiver.feed(0, first.task.inline_payload)
            while receiver.received < info.wire_size:
                message = await self._read(call)
                if message is grpc.aio.EOF:
                    break
                receiver.feed(*codec.chunk_from_proto(message.chunk))
            receiver.finish()
        except MessageRejectedError as exc:
            self.stats.errors.append(f"tasks: the task failed verification: {exc}")
            return None
        if task.kind is TaskKind.FIT:
            self.stats.fit_received.append((task.round, time.time()))
        self.stats.download_s.append(time.perf_counter() - header_at)
        return task, info

    async def _answer(self, stub: Any, push: Any, task: TaskHeader, model: PayloadInfo
                      ) -> None:
        assert self.session is not None
        started = 0.0
        try:
            if task.kind is TaskKind.FIT:
                await asyncio.sleep(self.rng.uniform(0.0, self.train_s))
                info, payload = self.updates.pick(model.specs, self.rng)
                header = ResultHeader(
                    self.session, task.task_id, task.round, TaskKind.FIT,
                    num_examples=self.rng.randint(10, 100), base_round=task.round - 1,
                    metrics={"train_loss": self.rng.random()}, update=info,
                )
                started = time.perf_counter()
                if self._inline and len(payload) <= inline_limit(self._chunk_size):
                    await stub.Report(codec.result_to_proto(header, inline=payload),
                                      timeout=self.rpc_timeout_s)
                else:
                    frames = [codec.result_to_proto(header)] + [
                        codec.chunk_frame(offset, data)
                        for offset, data in iter_chunk_views(payload, self._chunk_size)]
                    await push(iter(frames), timeout=self.rpc_timeout_s)
                self.stats.push_fit_s.append(time.perf_counter() - started)
                self.stats.fits += 1
            elif task.kind is TaskKind.EVALUATE:
                header = ResultHeader(
                    self.session, task.task_id, task.round, TaskKind.EVALUATE,
                    num_examples=self.rng.randint(10, 100), loss=self.rng.random(),
                    metrics={"accuracy": self.rng.random()},
                )
                started = time.perf_counter()
                await stub.Report(codec.result_to_proto(header), timeout=self.rpc_timeout_s)
                self.stats.push_evaluate_s.append(time.perf_counter() - started)
                self.stats.evaluations += 1
            else:
                self.stats.errors.append(f"tasks: unexpected task kind {task.kind}")
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
                self.stats.refused.append(exc.details() or "")  # e.g. "round N closed"
            else:
                self._error("push" if task.kind is TaskKind.FIT else "report", exc)


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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
    updates = UpdatePool(seed * 7_919 + indices.start)
    clients = [
        LoadClient(i, address, stats, updates, seed=seed, ramp_s=ramp_s, train_s=train_s)
        for i in indices
    ]
    results = await asyncio.gather(*(c.run() for c in clients), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            stats.errors.append(f"client crashed: {type(result).__name__}: {result}")
    return stats
