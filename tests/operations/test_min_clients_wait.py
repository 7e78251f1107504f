"""``min_clients_wait_s``: a server short of clients for that long stops (exit status 75,
every committed round kept) instead of waiting forever; 0 keeps waiting."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from helpers import small_weights

from fedloom import cli
from fedloom.config import ServerConfig
from fedloom.errors import ClientsUnavailableError, ConfigError
from fedloom.messages import PROTOCOL_VERSION, JoinRequest
from fedloom.server import save_weights
from fedloom.server.fleet import Fleet


def _fleet(tmp_path: Path, wait_s: float) -> Fleet:
    return Fleet(ServerConfig(min_clients=3, min_fit_clients=1, state_dir=str(tmp_path),
                              progress=False, insecure=True, min_clients_wait_s=wait_s), "run")


def test_the_wait_ends_at_the_limit_with_the_count_and_the_fix(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, 0.3)
    fleet.join(JoinRequest(PROTOCOL_VERSION, frozenset({"fit"}), "a"))

    async def main() -> float:
        started = time.monotonic()
        with pytest.raises(ClientsUnavailableError,
                           match=r"only 1 of the 3 clients .* min_clients_wait_s \(0\.3 s\)"
                                 r".*start it again"):
            async with asyncio.timeout(5):
                await fleet.wait_for(3)
        return time.monotonic() - started

    assert 0.3 <= asyncio.run(main()) < 2.0


def test_clients_that_come_in_time_end_the_wait_and_no_limit_waits_on(tmp_path: Path) -> None:
    for limit in (5.0, 0.0):
        fleet = _fleet(tmp_path, limit)

        async def main(f: Fleet = fleet) -> int:
            waiting = asyncio.create_task(f.wait_for(2))
            await asyncio.sleep(0.4)  # past what a 0.3 s limit would allow, not past 5 s
            assert not waiting.done()
            for name in ("a", "b"):
                f.join(JoinRequest(PROTOCOL_VERSION, frozenset({"fit"}), name))
            async with asyncio.timeout(5):
                return len(await waiting)

        assert asyncio.run(main()) == 2


def test_the_limit_is_checked() -> None:
    with pytest.raises(ConfigError, match="min_clients_wait_s"):
        ServerConfig(insecure=True, min_clients_wait_s=-1)


def test_fedloom_server_stops_with_status_75_and_says_why(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save_weights(tmp_path / "initial.safetensors", small_weights())
    with caplog.at_level(logging.ERROR, logger="fedloom.server"):
        code = cli.main(["server", "--insecure", "--address", "127.0.0.1:0",
                         "--initial-weights", str(tmp_path / "initial.safetensors"),
                         "--state-dir", str(tmp_path), "--min-clients-wait-s", "0.5",
                         "--progress", "false"])
    assert code == cli.EXIT_STOPPED == 75
    assert "the server stops: only 0 of the 2 clients" in caplog.text
