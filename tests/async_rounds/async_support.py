"""Asynchronous-rounds test helpers: the server's coordinator driven by hand, in process.

`Harness` runs a real `Coordinator` (task book, async driver, round loop, persistence)
on an event loop with clients joined through its front door; the test plays the clients:
it reads each client's offered task and pushes a chosen delta through the same
`accept_result` -> `Upload` path the gRPC servicer uses, so the order of arrivals is
exactly the test's (the numpy reference is `fedbuff.fedbuff_reference`).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from fedbuff import Arrival, client_delta, initial_weights

from fedloom import Weights
from fedloom.config import RoundsConfig, ServerConfig, StrategyConfig
from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.messages import PROTOCOL_VERSION, JoinRequest, ResultHeader, Session, TaskHeader
from fedloom.payload import PayloadInfo, iter_chunks, serialize
from fedloom.server.async_rounds import AsyncRounds
from fedloom.server.coordinator import Coordinator
from fedloom.server.persistence import RunPersistence
from fedloom.server.registry import ClientRecord
from fedloom.strategies import build_strategy
from fedloom.types import TaskKind


def async_config(state_dir: Path, *, num_rounds: int = 3, strategy: str = "fedavg",
                 strategy_params: dict[str, Any] | None = None, min_clients: int = 1,
                 **rounds: Any) -> ServerConfig:
    settings = dict(mode="async", concurrency=3, buffer_size=2, max_staleness=10)
    settings.update(rounds)
    return ServerConfig(
        num_rounds=num_rounds, min_clients=min_clients, min_fit_clients=1,
        state_dir=str(state_dir),
        progress=False, insecure=True, keep_checkpoints=50, fraction_evaluate=0.0,
        round_timeout_s=30.0, strategy=StrategyConfig(strategy, strategy_params or {}),
        rounds=RoundsConfig(**settings))


class Harness:
    """A coordinator running async rounds; clients are played by the test."""

    def __init__(self, config: ServerConfig, num_clients: int = 3,
                 initial: Weights | None = None, evaluate_fn: Any = None) -> None:
        self.config = config
        self.initial = initial if initial is not None else initial_weights()
        self.strategy = build_strategy(config.strategy, config.selection)
        self.persistence = RunPersistence.open(config, self.initial, self.strategy)
        self.coordinator = Coordinator(config, self.strategy, self.persistence,
                                       evaluate_fn=evaluate_fn)
        self.clients: list[ClientRecord] = []
        for i in range(num_clients):
            reply = self.coordinator.join(
                JoinRequest(PROTOCOL_VERSION, frozenset({"fit", "evaluate"}), f"site-{i}"))
            record = self.coordinator.registry.get(reply.session.client_id)
            assert record is not None
            self.clients.append(record)
        self.calls = [0] * num_clients  # tasks each client has answered
        self.run_task: asyncio.Task[None] | None = None

    @property
    def driver(self) -> AsyncRounds:
        driver = self.coordinator.driver
        assert isinstance(driver, AsyncRounds)
        return driver

    async def __aenter__(self) -> Harness:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def start(self) -> None:
        self.run_task = asyncio.get_running_loop().create_task(self.coordinator.run())

    async def stop(self) -> None:
        """Cancel the run (a stop, not the end of the run) and close the store."""
        if self.run_task is not None and not self.run_task.done():
            self.run_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.run_task
        self.persistence.close()

    async def task_of(self, client: int, timeout_s: float = 10.0) -> TaskHeader:
        """The fit task offered to ``client`` (waits for one)."""
        record = self.clients[client]
        async with asyncio.timeout(timeout_s):
            while True:
                task = self.coordinator.book.offer(record.client_id)
                if task is not None and task.header.kind is TaskKind.FIT:
                    return task.header
                await asyncio.sleep(0.005)

    async def holder(self, timeout_s: float = 10.0) -> int:
        """The index of a client that holds a task (waits for one)."""
        async with asyncio.timeout(timeout_s):
            while True:
                for i, record in enumerate(self.clients):
                    if self.coordinator.book.busy(record.client_id):
                        return i
                await asyncio.sleep(0.005)

    async def push(self, client: int, header: TaskHeader, delta: Weights, num_examples: int,
                   *, base_round: int | None = None,
                   metrics: dict[str, Any] | None = None) -> bool | None:
        """Send ``delta`` as the result of task ``header`` through the servicer's path.

        Returns whether it was a duplicate (None: a fresh result, folded)."""
        record = self.clients[client]
        payload = serialize(delta)
        result = ResultHeader(
            Session(record.client_id, b"test"), header.task_id, header.round, TaskKind.FIT,
            num_examples=num_examples,
            base_round=header.round - 1 if base_round is None else base_round,
            metrics=metrics or {}, update=PayloadInfo.describe(delta.specs(), payload))
        upload = await self.coordinator.accept_result(record, result)
        if isinstance(upload, bool):
            return upload
        for offset, chunk in iter_chunks(payload, 1 << 16):
            upload.feed(offset, chunk)
        await upload.finish()
        return None

    async def answer(self, client: int, num_examples: int) -> Arrival:
        """``client`` trains its offered task (a seeded delta) and pushes the result."""
        header = await self.task_of(client)
        delta = client_delta(client, self.calls[client], self.initial)
        self.calls[client] += 1
        await self.push(client, header, delta, num_examples)
        return Arrival(client, header.round - 1, delta, num_examples)

    async def committed(self, version: int, timeout_s: float = 20.0) -> None:
        """Wait until round (version) ``version`` is committed."""
        async with asyncio.timeout(timeout_s):
            while self.persistence.completed_round < version:
                await asyncio.sleep(0.005)


async def refused(coro: Any) -> MessageRejectedError:
    """The refusal ``coro`` raises (fails the test when it does not refuse)."""
    try:
        await coro
    except MessageRejectedError as exc:
        return exc
    raise AssertionError("the result was accepted; a refusal was expected")


def stale(exc: MessageRejectedError) -> bool:
    return exc.reason is RejectReason.STALE
