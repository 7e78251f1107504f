"""A server short of ``min_clients`` says so in its logs (text or JSON alike), when the
count changes and again while it does not — not only on a terminal's status line."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from fedloom.config import ServerConfig
from fedloom.messages import PROTOCOL_VERSION, JoinRequest
from fedloom.server import fleet as fleet_module
from fedloom.server.fleet import Fleet


def test_the_wait_for_clients_is_logged_and_repeated(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_module, "WAIT_LOG_S", 0.05)
    config = ServerConfig(min_clients=3, min_fit_clients=1, state_dir=str(tmp_path),
                          progress=False, insecure=True)
    fleet = Fleet(config, "run")

    async def main() -> None:
        waiting = asyncio.create_task(fleet.wait_for(3))
        await asyncio.sleep(0.02)
        fleet.join(JoinRequest(PROTOCOL_VERSION, frozenset({"fit"}), "a"))
        async with asyncio.timeout(5):
            while sum("1 of 3 connected" in r.getMessage() for r in caplog.records) < 2:
                await asyncio.sleep(0.01)  # the same count, said again after WAIT_LOG_S
        for name in ("b", "c"):
            fleet.join(JoinRequest(PROTOCOL_VERSION, frozenset({"fit"}), name))
        async with asyncio.timeout(5):
            assert len(await waiting) == 3

    with caplog.at_level(logging.INFO, logger="fedloom.server"):
        asyncio.run(main())
    waits = [r for r in caplog.records if r.getMessage().startswith("waiting for clients")]
    assert waits[0].getMessage().startswith("waiting for clients: 0 of 3 connected")
    assert {"connected", "needed", "waited_s"} <= set(vars(waits[-1]))  # JSON fields
    assert vars(waits[-1])["needed"] == 3
