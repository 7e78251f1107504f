"""Transfer turns: a bounded number of model streams at once, nobody stranded."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

import pytest
from helpers import ScriptedClient, run_clients, small_weights

from fedloom import ServerConfig
from fedloom.client_sdk import Client
from fedloom.server import Server
from fedloom.server import servicer as servicer_module
from fedloom.server.transfer_slots import TransferSlots


def test_no_more_than_limit_stream_at_once_and_uploads_go_in_order() -> None:
    async def scenario() -> tuple[int, list[int]]:
        slots = TransferSlots(limit=2)
        active, peak, finished = 0, 0, []

        async def upload(i: int) -> None:
            nonlocal active, peak
            async with slots.upload(1):
                active += 1
                peak = max(peak, active)
                await asyncio.sleep(0.01)
                active -= 1
                finished.append(i)

        tasks = []
        for i in range(7):
            tasks.append(asyncio.create_task(upload(i)))
            await asyncio.sleep(0)  # each queues before the next arrives
        await asyncio.gather(*tasks)
        return peak, finished

    peak, finished = asyncio.run(scenario())
    assert peak == 2
    assert finished == sorted(finished)  # first come, first served


def test_a_download_without_a_turn_in_time_is_told_to_ask_again() -> None:
    async def scenario() -> tuple[bool, bool, bool]:
        slots = TransferSlots(limit=1)
        async with slots.download(1.0, 1) as first, slots.download(0.05, 1) as second:
            pass
        async with slots.download(0.05, 1) as third:  # the turn was given back
            pass
        return first, second, third

    assert asyncio.run(scenario()) == (True, False, True)


def test_a_round_completes_with_one_turn_each_way(
    server_config: Callable[..., ServerConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six clients, one download and one upload at a time: all train, all are heard."""
    monkeypatch.setattr(servicer_module, "TransferSlots", functools.partial(TransferSlots, 1))
    config = server_config(num_rounds=2, min_clients=6, min_fit_clients=6)
    handle = Server(config, initial_weights=small_weights()).start()
    clients = [ScriptedClient(seed=i, num_examples=5) for i in range(6)]
    threads = run_clients(handle.address, list[Client](clients))
    history = handle.wait(120)
    for t in threads:
        t.join(15)
    assert [r.status for r in history] == ["ok", "ok"]
    assert [r.num_updates for r in history] == [6, 6]
    assert all(len(c.sent) == 2 for c in clients)
