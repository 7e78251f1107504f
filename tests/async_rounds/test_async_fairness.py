"""``rounds.max_updates_per_client``: one client cannot fill a server step's buffer.

Without a limit a client that answers at once gets a new task as soon as it returns one,
and can send every update of every buffer: a robust rule then chooses among that
client's own updates. With the limit, an idle client whose updates (and tasks in
flight) in the open buffer reach it gets no task until the buffer's step is taken;
clients sharing an authenticated identity count together.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from async_support import Harness, async_config
from fedbuff import client_delta, initial_weights

from fedloom import Weights
from fedloom.client_sdk import Client, EvaluateOutput, FitOutput
from fedloom.config import RoundsConfig, ServerConfig
from fedloom.errors import ConfigError
from fedloom.server import Server
from fedloom.simulations.local_async import run_local_async
from fedloom.simulations.speed import SpeedModel
from fedloom.strategies import FedAvg, FedMedian, Krum


async def _no_task_for(harness: Harness, client: int, seconds: float = 0.3) -> None:
    """``client`` is offered no task for ``seconds`` (the loop keeps topping up)."""
    record = harness.clients[client]
    deadline = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < deadline:
        assert harness.coordinator.book.offer(record.client_id) is None
        await asyncio.sleep(0.01)


async def _run_ends(harness: Harness) -> None:
    """The run (its last step taken) comes to its end."""
    assert harness.run_task is not None
    await asyncio.wait_for(harness.run_task, 20)


def test_a_client_at_its_limit_gets_no_task_until_the_step(tmp_path: Path) -> None:
    config = async_config(tmp_path / "s", num_rounds=2, buffer_size=3, concurrency=3,
                          max_updates_per_client=1, min_clients=3, strategy="fedmedian")

    async def main() -> None:
        async with Harness(config) as harness:
            await harness.answer(0, 10)  # the fast one: in the buffer at once
            await _no_task_for(harness, 0)
            await harness.answer(1, 10)
            await _no_task_for(harness, 0)
            await harness.answer(2, 10)  # the buffer is full: the step is taken
            await harness.committed(1)
            assert (await harness.task_of(0)).round == 2  # its turn again
            for client in range(3):
                await harness.answer(client, 10)
            await _run_ends(harness)

    asyncio.run(main())


def test_sessions_of_one_identity_count_together(tmp_path: Path) -> None:
    config = async_config(tmp_path / "s", num_rounds=1, buffer_size=2, concurrency=3,
                          max_updates_per_client=1, min_clients=2)

    async def main() -> None:
        harness = Harness(config)
        for record in harness.clients[:2]:  # two sessions, one certificate
            record.identity = "mallory"
        harness.start()
        try:
            # At most one task in flight for mallory's two sessions, one for site-2.
            await harness.task_of(2)
            holders = [i for i in (0, 1)
                       if harness.coordinator.book.offer(harness.clients[i].client_id)]
            assert len(holders) == 1
            await harness.answer(holders[0], 10)
            await _no_task_for(harness, 1 - holders[0])  # mallory is at its limit
            await harness.answer(2, 10)
            await _run_ends(harness)
        finally:
            await harness.stop()

    asyncio.run(main())


def test_the_limit_is_kept_in_the_durable_buffer_across_a_restart(tmp_path: Path) -> None:
    config = async_config(tmp_path / "s", num_rounds=1, buffer_size=2, concurrency=2,
                          max_updates_per_client=1, min_clients=2)

    async def before() -> None:
        harness = Harness(config, num_clients=2)
        harness.clients[0].identity = "site-a"
        harness.start()
        try:
            header = await harness.task_of(0)
            await harness.push(0, header, client_delta(0, 0, harness.initial), 10)
        finally:
            await harness.stop()

    async def after() -> None:
        harness = Harness(config, num_clients=2)
        harness.clients[0].identity = "site-a"  # the same site, a new session
        harness.start()
        try:
            (entry,) = harness.driver._open.entries
            assert entry.contributor == "site-a"
            await _no_task_for(harness, 0)  # its update is still in the open buffer
            await harness.answer(1, 10)
            await _run_ends(harness)
        finally:
            await harness.stop()

    asyncio.run(before())
    asyncio.run(after())


def test_settings_that_could_never_fill_a_buffer_or_leave_a_robust_rule_open_are_refused(
        tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"max_updates_per_client.*must be >= 0"):
        RoundsConfig(mode="async", max_updates_per_client=-1)
    with pytest.raises(ConfigError, match=r"cannot fill a buffer of rounds.buffer_size = 10: "
                                          r"raise min_clients to 10"):
        ServerConfig(insecure=True, min_clients=2, rounds=RoundsConfig(
            mode="async", buffer_size=10, max_updates_per_client=1))
    ServerConfig(insecure=True, min_clients=5, rounds=RoundsConfig(
        mode="async", buffer_size=10, max_updates_per_client=2))  # 5 x 2 fill it
    config = async_config(tmp_path / "s", strategy="fedmedian")  # no limit
    with pytest.raises(ConfigError, match=r"one fast client can send every update.*set it "
                                          r"to 1"):
        Harness(config)
    with pytest.raises(ConfigError, match=r"rounds.max_updates_per_client: FedMedian"):
        Server(config, initial_weights=INITIAL)  # refused before anything is written
    # With a mean-based rule no limit is allowed (each update weighs 1/K at most).
    Harness(async_config(tmp_path / "t")).persistence.close()


class _Recording(FedAvg):
    """FedAvg that notes whose updates each step took."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[list[str]] = []

    def aggregate_fit(self, server_round, current, updates):  # type: ignore[no-untyped-def]
        taken = list(updates)
        self.steps.append(sorted(u.client_id for u in taken))
        return super().aggregate_fit(server_round, current, taken)


#: Client 0 fits 100 times faster than the three others.
FAST_FIRST = SpeedModel([0.01, 1.0, 1.0, 1.0])
INITIAL = Weights({"w": np.zeros(2, np.float32)})


class _Step(Client):
    def fit(self, weights: Weights, config: Any) -> FitOutput:
        return FitOutput(Weights({k: v + 1 for k, v in weights.items()}), 1, {})

    def evaluate(self, weights: Weights, config: Any) -> EvaluateOutput:
        return EvaluateOutput(0.0, 1)


@pytest.mark.parametrize("cap", [0, 1])
def test_the_local_async_engine_keeps_the_same_limit(cap: int) -> None:
    strategy = _Recording()
    rounds = RoundsConfig(mode="async", concurrency=4, buffer_size=3,
                          max_updates_per_client=cap)
    run_local_async(strategy, lambda i: _Step(), INITIAL, num_clients=4, num_rounds=4,
                    rounds=rounds, speed=FAST_FIRST)
    assert len(strategy.steps) == 4
    if cap:  # three different clients in every step
        assert all(len(set(ids)) == len(ids) for ids in strategy.steps), strategy.steps
    else:  # without the limit the fast client fills whole buffers
        assert any(len(set(ids)) == 1 for ids in strategy.steps), strategy.steps


def test_the_local_async_engine_refuses_what_the_server_refuses() -> None:
    # a ConfigError naming the setting (`fedloom simulate` prints it on one line; a bare
    # ValueError came out as a traceback)
    with pytest.raises(ConfigError, match="cannot fill a buffer") as info:
        run_local_async(FedAvg(), lambda i: _Step(), INITIAL, num_clients=4, num_rounds=1,
                        rounds=RoundsConfig(mode="async", buffer_size=5,
                                            max_updates_per_client=1), speed=FAST_FIRST)
    assert info.value.setting == "rounds.max_updates_per_client"
    with pytest.raises(ConfigError, match="set it to 1"):
        run_local_async(FedMedian(), lambda i: _Step(), INITIAL, num_clients=4, num_rounds=1,
                        rounds=RoundsConfig(mode="async", buffer_size=2), speed=FAST_FIRST)


@pytest.mark.parametrize(("buffer_size", "refused"), [(2, True), (3, False)])
def test_a_buffer_smaller_than_the_rules_minimum_is_refused_at_start(
        tmp_path: Path, buffer_size: int, refused: bool) -> None:
    """Every version is one buffer's updates: Krum with f = 0 needs 3, so a buffer of 2
    fails every version. Refused by the server and the simulation alike, naming
    buffer_size (a synchronous round's size may vary; a buffer's does not)."""
    rounds = RoundsConfig(mode="async", buffer_size=buffer_size, max_updates_per_client=1)
    krum = Krum(num_malicious_nodes=0)
    config = async_config(tmp_path / "s", buffer_size=buffer_size, max_updates_per_client=1,
                          min_clients=4, strategy="krum")
    for start in (lambda: Server(config),
                  lambda: run_local_async(krum, lambda i: _Step(), INITIAL, num_clients=4,
                                          num_rounds=1, rounds=rounds, speed=FAST_FIRST)):
        if refused:
            with pytest.raises(ConfigError, match=r"is 2, but KrumAggregator needs at least 3 "
                                                  r"updates a version") as info:
                start()
            assert info.value.setting == "rounds.buffer_size"
        else:
            start()


def test_joining_again_mid_upload_does_not_buy_a_second_update(tmp_path: Path) -> None:
    # mallory starts uploading, then joins again under its identity (its old session is
    # replaced; the upload goes on). Its update counts against "mallory", fixed when its
    # task was issued, so the new session gets no task until the step.
    from fedloom.messages import PROTOCOL_VERSION, JoinRequest, ResultHeader, Session
    from fedloom.payload import PayloadInfo, serialize
    from fedloom.types import TaskKind

    config = async_config(tmp_path / "s", num_rounds=1, buffer_size=3, concurrency=3,
                          max_updates_per_client=1, min_clients=3, strategy="fedmedian")

    def filled(harness: Harness, value: float) -> Weights:
        return Weights({k: np.full(v.shape, value, v.dtype) for k, v in harness.initial.items()})

    async def main() -> Weights:
        harness = Harness(config)
        for record, name in zip(harness.clients, ["mallory", "site-1", "site-2"], strict=True):
            record.identity = name
        harness.start()
        try:
            mallory = harness.clients[0]
            header = await harness.task_of(0)
            delta = filled(harness, 100.0)
            payload = serialize(delta)
            upload = await harness.coordinator.accept_result(mallory, ResultHeader(
                Session(mallory.client_id, b"test"), header.task_id, header.round,
                TaskKind.FIT, num_examples=10, base_round=header.round - 1,
                update=PayloadInfo.describe(delta.specs(), payload)))
            assert not isinstance(upload, bool)
            upload.feed(0, payload[: len(payload) // 2])
            reply = harness.coordinator.join(JoinRequest(
                PROTOCOL_VERSION, frozenset({"fit", "evaluate"}), "mallory"), identity="mallory")
            again = harness.coordinator.registry.get(reply.session.client_id)
            assert again is not None and mallory.client_id not in harness.coordinator.registry
            await harness.push(1, await harness.task_of(1), filled(harness, 1.0), 10)
            upload.feed(len(payload) // 2, payload[len(payload) // 2:])
            await upload.finish()
            assert harness.driver._open.contributors["mallory"] == 1
            for _ in range(30):  # the new session is offered nothing before the step
                assert harness.coordinator.book.offer(again.client_id) is None
                await asyncio.sleep(0.01)
            await harness.push(2, await harness.task_of(2), filled(harness, 1.0), 10)
            await _run_ends(harness)
            return harness.coordinator.global_weights
        finally:
            await harness.stop()

    weights = asyncio.run(main())
    for name, start in initial_weights().items():  # the median of 100, 1, 1 is an honest 1
        np.testing.assert_allclose(weights[name], start + 1.0, rtol=1e-6)


def test_a_buffer_the_connected_clients_cannot_fill_is_waited_for_then_given_up(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Two clients, one update each per step, a buffer of 2: one answers, the other
    # leaves. The step can never fill until a client comes: the server says so, and
    # stops after min_clients_wait_s as it does while waiting for min_clients.
    from fedloom.errors import ClientsUnavailableError

    config = async_config(tmp_path / "s", num_rounds=1, buffer_size=2, concurrency=2,
                          max_updates_per_client=1, min_clients=2)
    config = dataclasses.replace(config, min_clients_wait_s=1.0)

    async def main() -> None:
        async with Harness(config, num_clients=2) as harness:
            await harness.answer(0, 10)
            harness.coordinator.leave(harness.clients[1], "test: gone")
            assert harness.run_task is not None
            with pytest.raises(ClientsUnavailableError, match=r"version 1 needs 1 more "
                               r"updates and the connected clients can send 0"):
                await asyncio.wait_for(harness.run_task, 20)

    with caplog.at_level(logging.INFO, logger="fedloom.server"):
        asyncio.run(main())
    assert "waiting for clients: version 1 needs 1 more updates, the connected clients " \
           "can send 0 (rounds.max_updates_per_client = 1" in caplog.text
